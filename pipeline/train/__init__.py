"""Drivers of a run: the loop, the mode runner, elastic generation, the graph."""
