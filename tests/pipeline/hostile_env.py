"""Environments a careless user writes, named ``"hostile_env:Class"`` by the pre-flight and
failing-episode tests (test_ecosystem.py)."""

from __future__ import annotations


class NotAnEnvironment:
    """Has neither ``reset`` nor ``step``."""

    def play(self) -> None:
        pass


class NeedsColour:
    """Every episode fails at ``reset``, as a misspelt ``env_kwargs`` key would make it."""

    def __init__(self, colour: str = "") -> None:
        self.colour = colour

    def reset(self, row: dict) -> str:
        raise KeyError(f"no such colour {self.colour!r}; env_kwargs needs colour = 'red'")

    def step(self, turn: str):
        return "", 0.0, True
