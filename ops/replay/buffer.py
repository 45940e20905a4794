"""Experience replay: a bounded buffer of recent trajectory groups (ReFlow-style).

A *group* is every sample of one prompt from one batch, with its advantages: the rows of a
trainable table (``ops/data/schema.py``) that share a ``prompt_id``. The buffer stores and returns
whole groups, never single samples, because advantages are relative to the group.

Contracts:

* **Age.** A group's age is ``current_version - policy_version`` (the oldest version among
  its rows), where ``current_version`` is the trainer that will consume it. ``sample`` only
  returns groups with ``0 <= age <= max_age``, and drops older ones for good.
* **Size.** At most ``max_groups`` groups; ``add`` beyond that drops the oldest (lowest
  version, then earliest added).
* **Preference.** A group's weight is ``priority / (1 + replays so far) * age_decay**age``,
  with priority 1 when its advantages are not all zero and ``zero_adv_weight`` (default 0)
  when they are: such a group adds no policy gradient, so by default it is not even stored.
  ``sample`` draws without replacement in proportion to the weights; ``age_decay`` < 1 makes
  the replayed share fall with age.
* **Never twice in a batch.** ``sample(..., exclude=prompt_ids)`` passes over the groups of
  those prompts (the prompts fresh in the batch being drawn): a prompt is never trained
  fresh and replayed in one step, where its stale baseline would contradict the fresh one.
* **Longest replaced, boundedly.** ``replace(prompt_ids, n, version)`` takes a batch's
  prompts, listed the predicted longest first, and replaces the first of them with up to
  ``n`` replayed groups, so the fresh generation loses its longest sequences. A prompt
  replaced at its last ``max_skips`` draws in a row is passed over (it is generated fresh at
  this one), so a prompt is never left untrained fresh for more than ``max_skips``
  consecutive draws.
* **Faithful rows.** Rows come back exactly as added: their ``policy_version``, behaviour
  ``logprobs`` and ``advantage`` unchanged, so the trainer corrects them like any other
  off-policy sample (``ops/algo/offpolicy.py``).
* **Determinism.** The k-th call of ``sample`` draws from ``numpy.random.default_rng([seed,
  k])``, so a buffer restored from its state continues exactly as the original would.
* **State.** ``state_dict()`` is two Arrow tables, ready for a checkpoint as they are:
  ``replay_rows`` (the stored rows plus an int64 ``replay_group`` column) and
  ``replay_groups`` (one row per group: ``replay_group``, ``version``, ``priority``,
  ``uses``; its schema metadata holds the counters ``draws`` and ``next_group``).
  A third table, ``replay_skips`` (``prompt_id``, ``skips``), holds the consecutive draws at
  which each replaced prompt was replaced. ``load_state_dict`` restores a buffer from them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..algo.advantage import group_index
from ..data.schema import TRAINABLE, check_columns

READS = pa.schema([TRAINABLE.field("prompt_id"), TRAINABLE.field("policy_version"),
                   TRAINABLE.field("advantage")])
SKIPS = pa.schema([pa.field("prompt_id", pa.string()), pa.field("skips", pa.int64())])
GROUPS = pa.schema([pa.field("replay_group", pa.int64()), pa.field("version", pa.int64()),
                    pa.field("priority", pa.float64()), pa.field("uses", pa.int64())])


@dataclass
class Group:
    id: int
    rows: pa.Table
    prompt_id: str
    version: int  # the oldest policy_version among the rows
    priority: float
    uses: int = 0  # times replayed


class ReplayBuffer:
    """Recent groups, bounded by age and size; see the module docstring."""

    def __init__(self, max_groups: int, max_age: int, *, seed: int = 0,
                 zero_adv_weight: float = 0.0, age_decay: float = 1.0,
                 max_skips: int = 1) -> None:
        if max_groups < 1:
            raise ValueError(f"ReplayBuffer: max_groups must be >= 1, got {max_groups}")
        if max_age < 0:
            raise ValueError(f"ReplayBuffer: max_age must be >= 0, got {max_age}")
        if not zero_adv_weight >= 0:
            raise ValueError(f"ReplayBuffer: zero_adv_weight must be >= 0, got "
                             f"{zero_adv_weight}")
        if not 0 < age_decay <= 1:
            raise ValueError(f"ReplayBuffer: age_decay must be in (0, 1], got {age_decay}")
        if max_skips < 1:
            raise ValueError(f"ReplayBuffer: max_skips must be >= 1, got {max_skips}")
        self.max_groups, self.max_age, self.max_skips = max_groups, max_age, max_skips
        self.seed, self.zero_adv_weight, self.age_decay = seed, zero_adv_weight, age_decay
        self.groups: list[Group] = []
        self.draws = 0  # calls of sample so far
        self.next_group = 0
        self.skips: dict[str, int] = {}  # prompt -> consecutive draws it was replaced at

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, trainable: pa.Table) -> int:
        """Store the groups of ``trainable`` (whole groups: every row of a prompt_id);
        returns how many were stored."""
        check_columns(trainable, READS, "ReplayBuffer.add")
        if trainable.num_rows == 0:
            return 0
        rows = trainable.replace_schema_metadata(None)
        group, ids = group_index(rows.column("prompt_id"))  # group: [N]
        version = rows.column("policy_version").to_numpy()
        informative = np.bincount(group, weights=rows.column("advantage").to_numpy() != 0,
                                  minlength=len(ids)) > 0  # [G]
        added = 0
        for g in range(len(ids)):
            priority = 1.0 if informative[g] else self.zero_adv_weight
            if priority == 0:
                continue
            members = np.flatnonzero(group == g)
            self.groups.append(Group(self.next_group, rows.take(members), ids[g],
                                     int(version[members].min()), priority))
            self.next_group += 1
            added += 1
        if len(self.groups) > self.max_groups:
            newest = sorted(self.groups, key=lambda grp: (grp.version, grp.id))
            keep = {grp.id for grp in newest[-self.max_groups:]}
            self.groups = [grp for grp in self.groups if grp.id in keep]
        return added

    def evict(self, current_version: int) -> int:
        """Drop the groups older than ``max_age`` for a trainer at ``current_version``;
        returns how many. A group newer than the trainer is an error (versions only grow)."""
        newer = [grp for grp in self.groups if grp.version > current_version]
        if newer:
            raise ValueError(f"ReplayBuffer: a group of policy v{newer[0].version} is newer "
                             f"than the trainer's v{current_version}")
        before = len(self.groups)
        self.groups = [grp for grp in self.groups
                       if current_version - grp.version <= self.max_age]
        return before - len(self.groups)

    def sample(self, n_groups: int, current_version: int,
               exclude: Collection[str] = ()) -> list[pa.Table]:
        """Up to ``n_groups`` groups (fewer when fewer are young enough), one table each,
        drawn without replacement by weight for a trainer at ``current_version``, none of a
        prompt in ``exclude``."""
        if n_groups < 0:
            raise ValueError(f"ReplayBuffer.sample: n_groups must be >= 0, got {n_groups}")
        self.evict(current_version)
        rng = np.random.default_rng([self.seed, self.draws])
        self.draws += 1
        banned = set(exclude)
        allowed = [grp for grp in self.groups if grp.prompt_id not in banned]
        k = min(n_groups, len(allowed))
        if k == 0:
            return []
        weight = np.array([grp.priority / (1 + grp.uses)
                           * self.age_decay ** (current_version - grp.version)
                           for grp in allowed])
        chosen = rng.choice(len(allowed), size=k, replace=False, p=weight / weight.sum())
        out = []
        for i in sorted(chosen.tolist()):
            allowed[i].uses += 1
            out.append(allowed[i].rows)
        return out

    def replace(self, prompt_ids: Sequence[str], n_groups: int,
                current_version: int) -> tuple[list[int], list[pa.Table]]:
        """Replace up to ``n_groups`` of a batch's prompts (``prompt_ids``, the first to
        replace first) with replayed groups for a trainer at ``current_version``; returns the
        positions in ``prompt_ids`` of the prompts replaced and the groups. Passed over: a
        prompt replaced at its last ``max_skips`` draws, and any beyond the groups the buffer
        holds of prompts outside the batch."""
        self.evict(current_version)
        batch = set(prompt_ids)
        spare = sum(grp.prompt_id not in batch for grp in self.groups)
        may = [k for k, p in enumerate(prompt_ids) if self.skips.get(p, 0) < self.max_skips]
        replaced = may[:min(n_groups, spare)]
        gone = set(replaced)
        kept = [p for k, p in enumerate(prompt_ids) if k not in gone]
        groups = self.sample(len(replaced), current_version, exclude=kept)
        for k in replaced:
            self.skips[prompt_ids[k]] = self.skips.get(prompt_ids[k], 0) + 1
        for p in kept:
            self.skips.pop(p, None)
        return replaced, groups

    def ages(self, current_version: int) -> np.ndarray:
        """[G] int64: each stored group's age for a trainer at ``current_version``."""
        return np.array([current_version - grp.version for grp in self.groups], np.int64)

    # ---- state, for checkpoints ----------------------------------------------------------

    def state_dict(self) -> dict[str, pa.Table]:
        """The buffer as two Arrow tables (see the module docstring)."""
        meta = {"draws": str(self.draws), "next_group": str(self.next_group)}
        groups = pa.table({"replay_group": [g.id for g in self.groups],
                           "version": [g.version for g in self.groups],
                           "priority": [g.priority for g in self.groups],
                           "uses": [g.uses for g in self.groups]},
                          schema=GROUPS).replace_schema_metadata(meta)
        tables = [g.rows.append_column("replay_group", pa.array(
            np.full(g.rows.num_rows, g.id), pa.int64())) for g in self.groups]
        rows = pa.concat_tables(tables) if tables else TRAINABLE.append(
            pa.field("replay_group", pa.int64())).empty_table()
        skips = pa.table({"prompt_id": list(self.skips), "skips": list(self.skips.values())},
                         schema=SKIPS)
        return {"replay_rows": rows, "replay_groups": groups, "replay_skips": skips}

    def load_state_dict(self, state: dict[str, pa.Table]) -> None:
        """Restore the buffer from ``state_dict()``'s tables (as a checkpoint returns them)."""
        missing = {"replay_rows", "replay_groups"} - set(state)
        if missing:
            raise ValueError(f"ReplayBuffer.load_state_dict: missing tables {sorted(missing)}")
        groups, rows = state["replay_groups"], state["replay_rows"]
        check_columns(groups, GROUPS, "ReplayBuffer.load_state_dict (replay_groups)")
        meta = groups.schema.metadata or {}
        if b"draws" not in meta or b"next_group" not in meta:
            raise ValueError("ReplayBuffer.load_state_dict: replay_groups lacks the metadata "
                             "'draws' and 'next_group'")
        check_columns(rows, pa.schema([GROUPS.field("replay_group")]),
                      "ReplayBuffer.load_state_dict (replay_rows)")
        ids = rows.column("replay_group").to_numpy()
        body = rows.drop_columns(["replay_group"])
        restored = []
        for gid, version, priority, uses in zip(*(groups.column(n).to_pylist()
                                                  for n in GROUPS.names)):
            members = np.flatnonzero(ids == gid)
            if members.size == 0:
                raise ValueError(f"ReplayBuffer.load_state_dict: group {gid} has no rows")
            rows_of = body.take(members)
            restored.append(Group(gid, rows_of, rows_of.column("prompt_id")[0].as_py(),
                                  version, priority, uses))
        self.groups = restored
        self.draws, self.next_group = int(meta[b"draws"]), int(meta[b"next_group"])
        skips = state.get("replay_skips", SKIPS.empty_table())  # absent: saved before skips
        check_columns(skips, SKIPS, "ReplayBuffer.load_state_dict (replay_skips)")
        self.skips = dict(zip(skips.column("prompt_id").to_pylist(),
                              skips.column("skips").to_pylist()))
