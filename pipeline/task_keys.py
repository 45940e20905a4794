"""The keys of the tasks a run submits: one grammar, built and read here.

    [<tag>-]<stage>-<iteration>[-<shard>[-<part>]]        generate-3-1, continue-3-1-0,
                                                          update-3, eval-generate-2-0

``stage`` is one word (``ITERATION_STAGES``, ``TAIL_STAGES``, ``eval``, ``chunk``, ...), the
numbers are the iteration, the shard and the part of a shard's tail (a move's index); a
``tag`` (words) marks a side graph such as the held-out evaluation, whose keys belong to no
iteration. ``dask.utils.key_split`` of an untagged key is its stage, so Dask's dashboard
groups the tasks by stage; ``stage_of`` and ``iteration_of`` read them back (stage timings,
the rendered graph, the async runner's task stream).
"""

from __future__ import annotations

from dataclasses import dataclass

ITERATION_STAGES = ("dedup", "shard", "generate", "reward", "advantage", "update", "publish")
TAIL_STAGES = ("resume", "continue", "export", "take", "split", "adopt")  # a paused tail's tasks
# one colour per iteration stage, shared by the rendered graph and the report's plots
STAGE_COLOURS = dict(zip(ITERATION_STAGES, ("#8dd3c7", "#ffffb3", "#fb8072", "#80b1d3",
                                            "#fdb462", "#b3de69", "#bc80bd")))


@dataclass(frozen=True)
class TaskKey:
    stage: str
    iteration: int
    shard: int | None = None
    part: int | None = None
    tag: str = ""


def task_key(stage: str, iteration: int, shard: int | None = None, part: int | None = None,
             tag: str = "") -> str:
    """The key of ``stage``'s task of ``iteration`` (and ``shard``, and ``part`` of it)."""
    if not stage.isalpha() or (part is not None and shard is None):
        raise ValueError(f"task_key: stage {stage!r}, shard {shard}, part {part}")
    numbers = [n for n in (iteration, shard, part) if n is not None]
    return "-".join([tag] * bool(tag) + [stage] + [str(n) for n in numbers])


def parse_key(key) -> TaskKey | None:
    """The parts of a key of this grammar (a tuple key: its name), or None for another key
    (Dask's own ``getitem-<hash>``, a rank's setup task)."""
    name = str(key[0] if isinstance(key, tuple) else key)
    words = name.split("-")
    first = next((i for i, w in enumerate(words) if w.isdigit()), len(words))
    head, numbers = words[:first], words[first:]
    if not head or not 1 <= len(numbers) <= 3 or not all(w.isdigit() for w in numbers) \
            or not all(w.isalpha() for w in head):
        return None
    ints = [int(n) for n in numbers] + [None, None]
    return TaskKey(head[-1], ints[0], ints[1], ints[2], "-".join(head[:-1]))


def stage_of(key) -> str | None:
    """The stage of a task key (None for a key outside the grammar)."""
    parsed = parse_key(key)
    return None if parsed is None else parsed.stage


def iteration_of(key) -> int | None:
    """The iteration of an untagged task key (``generate-3-1`` → 3); None otherwise."""
    parsed = parse_key(key)
    return None if parsed is None or parsed.tag else parsed.iteration
