"""The store over HTTP: the server (``agl store serve``), the client (``RemoteLightningStore``), their shared
wire format and transport, and OTLP span ingestion."""
