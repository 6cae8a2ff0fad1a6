"""Benchmarks: each module compares our code with the limit on the same machine, in the same run."""
