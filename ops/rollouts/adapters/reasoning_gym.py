"""reasoning-gym tasks, unchanged: ``dataset = "reasoning-gym:<task>"``.

``task_records(task, size, seed, **task_config)`` draws ``size`` entries with
``reasoning_gym.create_dataset(task, size=, seed=, **task_config)`` and makes one record per
entry: ``prompt`` the entry's ``question`` (one user message), ``answer`` its ``answer``,
``data_source`` ``"reasoning-gym:<task>"``, ``prompt_id`` ``"<task>:<seed>:<i>"``, and the
entry's ``question``, ``metadata`` and the ``task_config`` it was drawn with (JSON text) as
columns of their own. ``scorer(task)`` is the reward of that data source: the task's own
``score_answer(response_text, entry)`` on the entry rebuilt from the row (question, answer,
metadata), partial credit in [0, 1] included, by a dataset of the row's ``task_config`` (a
task such as ``puzzle24`` scores against its config's bounds), the task's defaults for a row
without one.
"""

from __future__ import annotations

import json

from .library import import_library

SIZE = 1000  # entries drawn when dataset_kwargs gives no size


def task_records(task: str, size: int = SIZE, seed: int = 0, **task_config) -> list[dict]:
    """The records of ``size`` entries of ``task`` drawn under ``seed``."""
    rg = import_library("reasoning_gym", "reasoning-gym")
    dataset = rg.create_dataset(task, size=size, seed=seed, **task_config)
    config = json.dumps(task_config, sort_keys=True, default=str)
    return [{"prompt_id": f"{task}:{seed}:{i}",
             "prompt": [{"role": "user", "content": entry["question"]}],
             "answer": str(entry["answer"]), "data_source": f"reasoning-gym:{task}",
             "question": entry["question"],
             # as JSON text: metadata differ in shape from task to task and entry to entry,
             # which one Arrow column cannot hold
             "metadata": json.dumps(entry.get("metadata", {}), default=str),
             "task_config": config}
            for i, entry in enumerate(dataset)]


def check_task(task: str) -> None:
    """``ValueError`` naming the known tasks unless ``task`` is one."""
    rg = import_library("reasoning_gym", "reasoning-gym")
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {task!r}; e.g. basic_arithmetic, "
                         f"chain_sum, leg_counting ({len(DATASETS)} in "
                         f"reasoning_gym {getattr(rg, '__version__', '')})")


def scorer(task: str):
    """``fn(response_text, answer, row) -> float``: the task's own ``score_answer``."""
    rg = import_library("reasoning_gym", "reasoning-gym")
    check_task(task)
    from reasoning_gym import get_score_answer_fn

    by_config = {"{}": get_score_answer_fn(task)}

    def score_answer_of(config: str):
        if config not in by_config:  # a dataset of one entry: its score_answer, its config
            by_config[config] = rg.create_dataset(task, size=1, seed=0,
                                                  **json.loads(config)).score_answer
        return by_config[config]

    def score(response_text: str, answer: str | None, row: dict) -> float:
        metadata = row.get("metadata")
        entry = {"question": row.get("question"), "answer": answer,
                 "metadata": json.loads(metadata) if isinstance(metadata, str) else
                 (metadata or {})}
        return float(score_answer_of(row.get("task_config") or "{}")(response_text, entry))

    score.__name__ = f"reasoning_gym_{task}"
    return score
