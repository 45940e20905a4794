"""reasoning-gym tasks, unchanged: ``dataset = "reasoning-gym:<task>"``.

``task_records(task, size, seed, **task_config)`` draws ``size`` entries with
``reasoning_gym.create_dataset(task, size=, seed=, **task_config)`` and makes one record per
entry: ``prompt`` the entry's ``question`` (one user message), ``answer`` its ``answer``,
``data_source`` ``"reasoning-gym:<task>"``, ``prompt_id`` ``"<task>:<seed>:<i>"``, and the
entry's ``question`` and ``metadata`` as columns of their own. ``scorer(task)`` is the
reward of that data source: the task's own ``score_answer(response_text, entry)`` on the
entry rebuilt from the row (question, answer, metadata), partial credit in [0, 1] included.
"""

from __future__ import annotations

import json

from .library import import_library

SIZE = 1000  # entries drawn when dataset_kwargs gives no size


def task_records(task: str, size: int = SIZE, seed: int = 0, **task_config) -> list[dict]:
    """The records of ``size`` entries of ``task`` drawn under ``seed``."""
    rg = import_library("reasoning_gym", "reasoning-gym")
    dataset = rg.create_dataset(task, size=size, seed=seed, **task_config)
    return [{"prompt_id": f"{task}:{seed}:{i}",
             "prompt": [{"role": "user", "content": entry["question"]}],
             "answer": str(entry["answer"]), "data_source": f"reasoning-gym:{task}",
             "question": entry["question"],
             # as JSON text: metadata differ in shape from task to task and entry to entry,
             # which one Arrow column cannot hold
             "metadata": json.dumps(entry.get("metadata", {}), default=str)}
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
    import_library("reasoning_gym", "reasoning-gym")
    check_task(task)
    from reasoning_gym import get_score_answer_fn

    score_answer = get_score_answer_fn(task)

    def score(response_text: str, answer: str | None, row: dict) -> float:
        metadata = row.get("metadata")
        entry = {"question": row.get("question"), "answer": answer,
                 "metadata": json.loads(metadata) if isinstance(metadata, str) else
                 (metadata or {})}
        return float(score_answer(response_text, entry))

    score.__name__ = f"reasoning_gym_{task}"
    return score
