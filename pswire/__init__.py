"""What shards and workers must agree on to talk: generated wire code, the messages and tensor
encoding (the wire forms of ``pscore``'s job, tables and step options), errors and their gRPC
status, channel and launch options, security. What both ends compute with is ``pscore``."""

__version__ = "0.2.0"
