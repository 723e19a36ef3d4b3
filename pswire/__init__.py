"""What shards and workers must agree on: generated wire code, tensor codec, errors, placement."""
