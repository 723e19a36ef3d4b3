"""What shards and workers must agree on: generated wire code, the job description, tensor
codec and push messages, errors and their gRPC status, optimizer math, tables, security."""

__version__ = "0.2.0"
