"""Durable runs: the run directory, zarr checkpoints, resume, recovery."""
