"""A reward for tests that need informative groups from an untrained model: the parity of
the response's length, so samples of one prompt disagree about half the time. Worker
processes import it by name (``"parity_reward:parity"``): they inherit the test's sys.path."""

from __future__ import annotations


def parity(response_text: str, answer: str | None) -> float:
    return float(len(response_text) % 2)
