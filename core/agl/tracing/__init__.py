"""Layer 2: spans. The tracer and its span model (``spans``), span encoding and export to a store, the writer
process, the rollout context (which rollout a call belongs to) and the user-facing emitters and ``@tool``."""
