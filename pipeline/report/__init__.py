"""A run read back: metrics, bookkeeping, run data, plots, HTML, notebooks."""
