"""Benchmarks: each runs a peer in the same run and prints the ratio to it."""
