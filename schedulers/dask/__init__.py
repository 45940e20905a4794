"""The Dask wiring of the pure policies: scheduler plugin, adaptive scaling."""
