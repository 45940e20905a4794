"""Generation-time model of one worker, fitted online from the run's own timings.

The scaling and migration policies ask "how long would this worker take to generate these
sequences?". The model answers with these quantities:

- decode step time ``t_step(b) = a + c*b`` seconds for a live batch of ``b`` sequences,
  fitted by (weighted) least squares over a bounded window of observations;
- prefill rate in prompt tokens per second (total tokens / total seconds over a window);
- cold start seconds (process start + model load), an EWMA of measured cold starts;
- a shard's seconds of waiting on environments or agents with nothing to decode
  (``env_wait_s``), an EWMA of the shards that reported it (0 before any did). The agents of
  a shard run at once, so the wait is charged once per busy worker, not per sequence: adding
  workers does not shorten it, and each one pays it.
- each busy worker's fetch of the iteration's policy version (``weight_fetch_s``): an EWMA
  of the fetches shards measured, or before any the prior (from the run's model size and
  measured rates: ``weight_costs.WeightCosts``); like the wait, once per busy worker, so
  more workers cost more fetches.

Under continuous batching a finished sequence leaves the batch, so at decode step ``s`` the
live batch is the number of sequences with length >= s. Summed over steps::

    sum_s (a + c * live(s)) = a * max_i(l_i) + c * sum_i(l_i)

because every token occupies exactly one (step, slot). The time of a worker is therefore
closed-form in the longest sequence and the total tokens. With an engine batch cap
``max_batch`` (vLLM's ``max_num_seqs``) the token term stays exact and the number of steps is
approximated by its lower bound ``max(l_max, total / max_batch)``; the exact count depends on
admission order and exceeds the bound by less than ``l_max``.

Simplifications: step time does not grow with context length; prefill and decode do not
overlap; the priors are placeholders for a mid-size model on one GPU and are replaced as soon
as the run reports timings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

STATE_VERSION = 1

ArrayLike = np.ndarray | float | int


def _positive(name: str, value: float | None, allow_zero: bool = False) -> float:
    ok = value is not None and np.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"ThroughputModel: {name}={value!r}; allowed: a finite number {bound}")
    return float(value)


def _obs(name: str, values: ArrayLike, size: int | None = None) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    if arr.ndim != 1 or (size is not None and arr.size != size):
        raise ValueError(f"ThroughputModel.{name}: expected {size} values in a 1-D array")
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        raise ValueError(f"ThroughputModel.{name}: values must be finite and >= 0, got {arr}")
    return arr


class ThroughputModel:
    """Per-worker generation time model; priors until the run's timings replace them.

    Observations may arrive in any order at any time (the live plugin reports them as tasks
    finish; the simulator feeds synthetic ones). Predictions use the fit as of the last
    observation and never mutate the model.
    """

    def __init__(
        self,
        *,
        step_intercept_s: float = 0.02,  # prior a: a decode step of a tiny batch, seconds
        step_slope_s: float = 1e-4,  # prior c: extra seconds per sequence in the batch
        prefill_tokens_per_s: float = 20_000.0,  # prior prefill rate
        cold_start_s: float = 30.0,  # prior process start + model load
        max_batch: int | None = None,  # engine cap on live sequences; None = no cap
        window: int = 1024,  # observations kept for the decode and prefill fits
        cold_start_alpha: float = 0.3,  # EWMA weight of the newest measured cold start
        weight_fetch_s: float = 0.0,  # a worker's fetch of each version (``WeightCosts``)
    ) -> None:
        self.prior_intercept_s = _positive("step_intercept_s", step_intercept_s, allow_zero=True)
        self.prior_slope_s = _positive("step_slope_s", step_slope_s, allow_zero=True)
        self.prior_prefill_tokens_per_s = _positive("prefill_tokens_per_s", prefill_tokens_per_s)
        self.prior_cold_start_s = _positive("cold_start_s", cold_start_s, allow_zero=True)
        self.prior_weight_fetch_s = _positive("weight_fetch_s", weight_fetch_s, allow_zero=True)
        if max_batch is not None and (int(max_batch) != max_batch or max_batch < 1):
            raise ValueError(f"ThroughputModel: max_batch={max_batch!r}; allowed: None or int >= 1")
        if int(window) != window or window < 2:
            raise ValueError(f"ThroughputModel: window={window!r}; allowed: an integer >= 2")
        if not 0.0 < cold_start_alpha <= 1.0:
            raise ValueError(
                f"ThroughputModel: cold_start_alpha={cold_start_alpha!r}; allowed: (0, 1]"
            )
        self.max_batch = None if max_batch is None else int(max_batch)
        self.window = int(window)
        self.cold_start_alpha = float(cold_start_alpha)
        self._decode = np.zeros((0, 3))  # rows: batch size, seconds per step, n steps (weight)
        self._prefill = np.zeros((0, 2))  # rows: tokens, seconds
        self._cold: float | None = None
        self._n_cold = 0
        self._wait: float | None = None
        self._n_wait = 0
        self._fetch: float | None = None
        self._n_fetch = 0
        self._refit()

    # ---- fitted parameters -----------------------------------------------------------------

    @property
    def step_intercept_s(self) -> float:
        """Fitted ``a`` of ``t_step(b) = a + c*b`` (seconds)."""
        return self._a

    @property
    def step_slope_s(self) -> float:
        """Fitted ``c`` of ``t_step(b) = a + c*b`` (seconds per live sequence)."""
        return self._c

    @property
    def prefill_tokens_per_s(self) -> float:
        """Measured prefill rate (prompt tokens per second), or the prior."""
        if self._prefill.shape[0] == 0 or self._prefill[:, 1].sum() <= 0:
            return self.prior_prefill_tokens_per_s
        return float(self._prefill[:, 0].sum() / self._prefill[:, 1].sum())

    @property
    def cold_start_s(self) -> float:
        """EWMA of measured cold starts (seconds), or the prior before any was measured."""
        return self.prior_cold_start_s if self._cold is None else self._cold

    @property
    def weight_fetch_s(self) -> float:
        """EWMA of measured version fetches (seconds), or the prior before any was measured."""
        return self.prior_weight_fetch_s if self._fetch is None else self._fetch

    @property
    def env_wait_s(self) -> float:
        """EWMA of a shard's measured wait on environments or agents (seconds), or 0."""
        return 0.0 if self._wait is None else self._wait

    def _refit(self) -> None:
        b, y, w = self._decode.T if self._decode.size else (np.zeros(0),) * 3
        self._a, self._c = self.prior_intercept_s, self.prior_slope_s
        if w.sum() <= 0:
            return
        bm = np.average(b, weights=w)
        ym = np.average(y, weights=w)
        var = np.average((b - bm) ** 2, weights=w)
        if var <= 1e-12 * max(bm * bm, 1.0):
            # one batch size seen: keep the prior slope, fit only the intercept
            self._a = max(ym - self._c * bm, 0.0)
            return
        c = np.average((b - bm) * (y - ym), weights=w) / var
        a = ym - c * bm
        if c < 0:
            c, a = 0.0, ym
        if a < 0:
            a, c = 0.0, float(np.sum(w * b * y) / np.sum(w * b * b))
        self._a, self._c = float(a), float(c)

    # ---- observations ----------------------------------------------------------------------

    def observe_decode(
        self, batch_sizes: ArrayLike, step_seconds: ArrayLike, n_steps: ArrayLike | None = None
    ) -> None:
        """Add decode timings: live batch size and seconds per step, optionally weighted.

        A chunk of ``k`` steps whose live batch averaged ``b`` and took ``s`` seconds is one
        observation ``(b, s / k, k)``; for the linear step model this is exact.
        """
        b = _obs("observe_decode(batch_sizes)", batch_sizes)
        y = _obs("observe_decode(step_seconds)", step_seconds, b.size)
        w = np.ones(b.size) if n_steps is None else _obs("observe_decode(n_steps)", n_steps, b.size)
        rows = np.column_stack([b, y, w])
        self._decode = np.concatenate([self._decode, rows])[-self.window :]
        self._refit()

    def observe_prefill(self, tokens: ArrayLike, seconds: ArrayLike) -> None:
        """Add prefill timings: prompt tokens prefilled and the seconds it took."""
        t = _obs("observe_prefill(tokens)", tokens)
        s = _obs("observe_prefill(seconds)", seconds, t.size)
        self._prefill = np.concatenate([self._prefill, np.column_stack([t, s])])[-self.window :]

    def observe_cold_start(self, seconds: float) -> None:
        """Add one measured cold start (worker start to engine ready), in seconds."""
        s = float(_obs("observe_cold_start(seconds)", seconds, 1)[0])
        a = 1.0 if self._cold is None else self.cold_start_alpha
        self._cold = a * s + (1.0 - a) * (self._cold or 0.0)
        self._n_cold += 1

    def observe_weight_fetch(self, seconds: float) -> None:
        """Add one measured fetch of a version into a worker's engine, in seconds."""
        s = float(_obs("observe_weight_fetch(seconds)", seconds, 1)[0])
        a = 1.0 if self._fetch is None else self.cold_start_alpha
        self._fetch = a * s + (1.0 - a) * (self._fetch or 0.0)
        self._n_fetch += 1

    def observe_env_wait(self, seconds: float) -> None:
        """Add one shard's seconds of waiting on its environments or agents, decoding
        nothing (``EpisodeStats.env_wait_seconds``)."""
        s = float(_obs("observe_env_wait(seconds)", seconds, 1)[0])
        a = 1.0 if self._wait is None else self.cold_start_alpha
        self._wait = a * s + (1.0 - a) * (self._wait or 0.0)
        self._n_wait += 1

    # ---- predictions -----------------------------------------------------------------------

    def t_step(self, batch_size: ArrayLike) -> np.ndarray:
        """Seconds of one decode step at live batch ``batch_size`` (vectorised)."""
        return self._a + self._c * np.asarray(batch_size, dtype=np.float64)

    def decode_seconds(self, max_len: ArrayLike, total_tokens: ArrayLike) -> np.ndarray:
        """Decode seconds of a worker whose longest sequence is ``max_len`` tokens and whose
        sequences total ``total_tokens`` (vectorised; see the module docstring)."""
        max_len = np.asarray(max_len, dtype=np.float64)
        total = np.asarray(total_tokens, dtype=np.float64)
        steps = max_len if self.max_batch is None else np.maximum(max_len, total / self.max_batch)
        return self._a * steps + self._c * total

    def prefill_seconds(self, prompt_tokens: ArrayLike) -> np.ndarray:
        """Seconds to prefill ``prompt_tokens`` tokens (vectorised)."""
        return np.asarray(prompt_tokens, dtype=np.float64) / self.prefill_tokens_per_s

    def worker_seconds(
        self, max_len: ArrayLike, total_tokens: ArrayLike, prompt_tokens: ArrayLike
    ) -> np.ndarray:
        """Prefill + decode seconds from per-worker totals (vectorised); no cold start."""
        return self.prefill_seconds(prompt_tokens) + self.decode_seconds(max_len, total_tokens)

    def predict_worker_seconds(self, lengths: np.ndarray, prompt_tokens: int) -> float:
        """Seconds for one warm worker to prefill ``prompt_tokens`` and decode sequences of
        ``lengths`` response tokens under continuous batching; no cold start included."""
        lengths = _obs("predict_worker_seconds(lengths)", lengths)
        if lengths.size == 0:
            return float(self.prefill_seconds(prompt_tokens))
        return float(self.worker_seconds(lengths.max(), lengths.sum(), prompt_tokens))

    # ---- records and state -----------------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        """Current fitted parameters and data counts, JSON-able (logged with each decision)."""
        return {
            "step_intercept_s": self._a,
            "step_slope_s": self._c,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "cold_start_s": self.cold_start_s,
            "weight_fetch_s": self.weight_fetch_s,
            "n_weight_fetch_obs": self._n_fetch,
            "max_batch": self.max_batch,
            "n_decode_obs": int(self._decode.shape[0]),
            "n_prefill_obs": int(self._prefill.shape[0]),
            "n_cold_start_obs": self._n_cold,
            "env_wait_s": self.env_wait_s,
            "n_env_wait_obs": self._n_wait,
        }

    def state_dict(self) -> dict[str, Any]:
        """Observation windows and cold-start EWMA as plain lists and floats."""
        return {
            "version": STATE_VERSION,
            "decode": self._decode.tolist(),
            "prefill": self._prefill.tolist(),
            "cold_start_s": self._cold,
            "n_cold_start_obs": self._n_cold,
            "env_wait_s": self._wait,
            "n_env_wait_obs": self._n_wait,
            "weight_fetch_s": self._fetch,
            "n_weight_fetch_obs": self._n_fetch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore observations from ``state_dict`` and refit; priors and config stay as built."""
        where = "ThroughputModel.load_state_dict"
        missing = [k for k in ("version", "decode", "prefill", "cold_start_s") if k not in state]
        if missing:
            raise ValueError(f"{where}: state lacks keys {missing}; expected those of state_dict()")
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"{where}: version {state['version']!r}; this code reads {STATE_VERSION}"
            )
        decode = np.asarray(state["decode"], dtype=np.float64).reshape(-1, 3)
        prefill = np.asarray(state["prefill"], dtype=np.float64).reshape(-1, 2)
        cold = state["cold_start_s"]
        self._decode = decode[-self.window :]
        self._prefill = prefill[-self.window :]
        self._cold = None if cold is None else float(cold)
        self._n_cold = int(state.get("n_cold_start_obs", 0 if cold is None else 1))
        wait = state.get("env_wait_s")  # absent in checkpoints of older runs: none seen
        self._wait = None if wait is None else float(wait)
        self._n_wait = int(state.get("n_env_wait_obs", 0 if wait is None else 1))
        fetch = state.get("weight_fetch_s")  # absent in checkpoints of older runs: none seen
        self._fetch = None if fetch is None else float(fetch)
        self._n_fetch = int(state.get("n_weight_fetch_obs", 0 if fetch is None else 1))
        self._refit()
