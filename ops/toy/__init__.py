"""Embedded toy models and tasks: the tiny Llama, tally, tally-tool, bench sizes."""
