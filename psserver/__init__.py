"""Parameter-server shard: variables, server-side optimizer, consistency rule, gRPC daemon."""
