"""The SQLite store: one file, many processes (``store``, on the connections of ``database``), its schema and
row conversions (``schema``), the check that a file is a store (``file_check``) and its background WAL
checkpoints (``checkpoints``)."""
