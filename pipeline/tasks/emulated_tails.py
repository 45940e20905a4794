"""The emulated engine's paused tails as data: exported, adopted, landed on the profile's clock.

A tail the emulated engine pauses (``Paused``) is rows and counts, no tensors: each cut
sequence's row (with its trace length), the tokens it generated so far and whether its KV
cache is held where it sits (``kv``: false for a row to be recomputed). ``export`` takes some
of them out as an ``EmulatedTail`` (what ``tasks/tail.py`` moves worker to worker: the same
fields a real engine's ``TailKV`` offers the driver), ``adopt`` builds one paused decoding
from exported tails and cut rows, and charges on the profile's clock what landing them takes:

- a KV transfer as PAT's model times it (``schedulers/pat.py: kv_move_seconds``): every GPU
  ships over its own link at once, so the slowest side sets the time, the most bytes one
  source sends or the bytes the target's GPUs receive (the pooled workers' links); a tail
  exported by this same process does not travel;
- a recomputation as prefill, in the resumed schedule's admitting steps (the engine's own
  step model), at the target's width.

``Paused.run`` is the schedule ``generate_until`` cut; once part of the tail left or was
adopted it is rescheduled on resume (``EmulatedEngine.resume``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pa_compute

from rlhfless.schedulers.profiles import LINK_EFFICIENCY, Profile
from rlhfless.schedulers.sim.engine import WorkerRun

LENGTH = "emulated_length"  # per (prompt, sample) row of a cut tail: its trace length


def lengths_of(column) -> np.ndarray:
    """Lengths of a list column's rows (no Python lists built)."""
    return pa_compute.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass
class Paused:
    """A paused decoding of the emulated engine (``Chunk.paused``): per sequence its row
    (prompt columns, ``sample_idx``, ``LENGTH``), tokens generated so far and whether its KV
    is here; ``run`` the schedule it was cut from (None once rescheduled), ``t_cut`` where,
    ``load_s`` emulated seconds to land it before its first step, ``started`` the wall time
    its generation began."""

    rows: pa.Table
    generated: np.ndarray
    kv: np.ndarray
    started: float
    run: WorkerRun | None = None
    t_cut: float = 0.0
    load_s: float = 0.0

    @property
    def context(self) -> np.ndarray:
        return lengths_of(self.rows.column("prompt_ids")) + self.generated

    @property
    def remaining(self) -> np.ndarray:
        return self.rows.column(LENGTH).to_numpy().astype(np.int64) - self.generated


@dataclass
class EmulatedTail:
    """Sequences exported from a paused decoding, with what a move's facts read
    (``tasks/tail.py``): ``nbytes`` (their KV at the profile's bytes per token),
    ``context_tokens``, ``exported_at``, ``export_s``; ``pid``: the exporting process."""

    rows: pa.Table
    generated: np.ndarray
    started: float
    kv_bytes_per_token: float
    pid: int
    exported_at: float
    export_s: float = 0.0

    @property
    def n_sequences(self) -> int:
        return len(self.rows)

    @property
    def context_tokens(self) -> int:
        return int((lengths_of(self.rows.column("prompt_ids")) + self.generated).sum())

    @property
    def nbytes(self) -> int:
        return int(self.context_tokens * self.kv_bytes_per_token)

    def take(self, positions: list[int]) -> EmulatedTail:
        """The part of this tail one target gets."""
        return EmulatedTail(self.rows.take(pa.array(positions, pa.int64())),
                            self.generated[positions], self.started, self.kv_bytes_per_token,
                            self.pid, self.exported_at, self.export_s)


def export(paused: Paused, positions: list[int] | None, profile: Profile) -> EmulatedTail:
    """The sequences at ``positions`` (all: None) of ``paused`` as a tail; ``paused`` keeps
    the others and is rescheduled when it resumes."""
    n = len(paused.rows)
    take = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    if take.size and (take.min() < 0 or take.max() >= n):
        raise ValueError(f"export: positions {positions} of a tail of {n}")
    tail = EmulatedTail(paused.rows.take(pa.array(take)), paused.generated[take],
                        paused.started, profile.kv_bytes_per_token, os.getpid(), time.time())
    keep = np.setdiff1d(np.arange(n), take)
    paused.rows, paused.generated = paused.rows.take(pa.array(keep)), paused.generated[keep]
    paused.kv, paused.run = paused.kv[keep], None
    return tail


def link_bytes_per_s(profile: Profile) -> float:
    """One worker's KV link: each of its ``tp`` GPUs over its own link inside the node (the
    profile's worker-to-worker link where it was not derived from hardware)."""
    if profile.hardware is not None:
        return profile.hardware.gpu_link_gbs * 1e9 * LINK_EFFICIENCY * profile.tp
    return profile.kv_link_gbs * 1e9


def transfer_seconds(tails: list[EmulatedTail], profile: Profile) -> float:
    """Seconds to land ``tails`` on this process's engine: the most bytes one remote source
    sends, or the remote bytes received over the pooled workers' links (one per tail),
    whichever is more, at ``link_bytes_per_s`` (``pat.kv_move_seconds``' rule)."""
    remote = [t.nbytes for t in tails if t.pid != os.getpid()]
    if not remote:
        return 0.0
    link = link_bytes_per_s(profile)
    if link <= 0:
        raise ValueError(f"profile {profile.name!r} has no KV link: its tails move by "
                         "recompute")
    return max(max(remote), sum(remote) / len(tails)) / link


def adopt(tails: list[EmulatedTail], recompute: pa.Table | None, profile: Profile) -> Paused:
    """One paused decoding of ``tails`` (KV landed, ``load_s`` charged) and the cut rows
    ``recompute`` (prefilled when the decoding resumes)."""
    parts = [t for t in tails if t.n_sequences]
    columns = parts[0].rows.column_names if parts else None
    rows = [t.rows for t in parts]
    generated = [t.generated for t in parts]
    kv = [np.ones(t.n_sequences, dtype=bool) for t in parts]
    if recompute is not None and len(recompute):
        cut = recompute.select(columns or [c for c in recompute.column_names
                                           if c not in ("partial_ids", "partial_logprobs")])
        rows.append(cut)
        generated.append(lengths_of(recompute.column("partial_ids")))
        kv.append(np.zeros(len(cut), dtype=bool))
    if not rows:
        raise ValueError("adopt: no tails and no rows to recompute")
    started = min((t.started for t in parts), default=time.time())
    return Paused(pa.concat_tables(rows), np.concatenate(generated), np.concatenate(kv),
                  started, load_s=transfer_seconds(parts, profile))
