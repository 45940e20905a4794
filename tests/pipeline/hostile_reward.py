"""A reward function as a careless user writes one, for tests: a third of the responses
score ``1e300`` (an overflow upstream), the rest the parity of their length, so groups
disagree. Worker processes import it by name (``"hostile_reward:overflowing"``): they
inherit the test's sys.path."""

from __future__ import annotations


def overflowing(response_text: str, answer: str | None) -> float:
    if len(response_text) % 3 == 0:
        return 1e300
    return float(len(response_text) % 2)
