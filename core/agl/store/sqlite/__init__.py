"""The SQLite store: one file, many processes (``store``), its schema and row conversions (``schema``) and its
background WAL checkpoints (``checkpoints``)."""
