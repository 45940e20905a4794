"""Per-prompt response-length predictor: an EWMA of each prompt's past lengths.

RLHFless predicts how long each prompt's responses will be from that prompt's own history
(prompts recur every epoch, and most per-prompt lengths move little between epochs), then
ranks prompts by the prediction to assign and scale generation workers. This module keeps,
per ``prompt_id``, three exponentially weighted moving averages:

- ``mean``: of the per-call mean response length over the prompt's samples, in tokens (the
  group's token work);
- ``max``: of the per-call max over the prompt's samples, in tokens (the group's makespan in
  steps);
- ``env``: of the per-call mean of the samples' ``env_seconds``, the seconds an episode spends
  outside the model (in its environment's calls or its agent's own code); 0 for prompts
  without environments or agents.

A prompt never seen before gets a quantile of the per-prompt values observed recently (a
bounded window, so the fallback follows the policy as its lengths drift), or
``default_length`` tokens (0 seconds) before anything has been observed.

Call order within an iteration: ``predict``/``predict_max`` to plan, generation, then
``error`` (which scores the predictions made *before* this iteration's lengths are known),
then ``observe``. Calling ``observe`` first would make ``error`` score a prediction that
already contains the answer.

Simplifications: lengths are response tokens only (prompt tokens are known exactly and are
not predicted); the EWMA weight ``alpha`` is the same for every prompt; every row of an agent
episode carries the episode's seconds, so an episode of several trajectories weighs more in
its prompt's mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

STATE_VERSION = 2  # 2: per-prompt seconds outside the model (``env``, ``recent_env``)


def _per_sample(prompt_ids: Sequence[str], values: Sequence[float], where: str,
                name: str = "length", unit: str = "tokens") -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size != len(prompt_ids):
        raise ValueError(
            f"{where}: got {len(prompt_ids)} prompt_ids but {array.size} {name}s; "
            f"pass one {name} per sample, aligned with prompt_ids"
        )
    if array.size and (not np.all(np.isfinite(array)) or array.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(array) | (array < 0))[0])
        raise ValueError(
            f"{where}: {name} at position {bad} (prompt {prompt_ids[bad]!r}) is "
            f"{array[bad]!r}; {name}s must be finite and >= 0 {unit}"
        )
    return array


def _env_per_sample(prompt_ids: Sequence[str], env_seconds: Sequence[float] | None,
                    where: str) -> np.ndarray:
    """The samples' seconds outside the model; none given: 0 each (no environment)."""
    if env_seconds is None:
        return np.zeros(len(prompt_ids))
    return _per_sample(prompt_ids, env_seconds, where, "env_seconds value", "seconds")


def _group(
    prompt_ids: Sequence[str], values: np.ndarray, env: np.ndarray
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Per-prompt mean and max of ``values`` and mean of ``env``, prompts in order of first
    appearance."""
    keys, first, inverse = np.unique(
        np.asarray(prompt_ids, dtype=str), return_index=True, return_inverse=True
    )
    counts = np.bincount(inverse, minlength=keys.size)
    means = np.bincount(inverse, weights=values, minlength=keys.size) / counts
    env_means = np.bincount(inverse, weights=env, minlength=keys.size) / counts
    maxes = np.full(keys.size, -np.inf)
    np.maximum.at(maxes, inverse, values)
    order = np.argsort(first, kind="stable")
    return keys[order].tolist(), means[order], maxes[order], env_means[order]


def _upgraded(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A state of version 1 (written before seconds outside the model were learned) as the
    current version: 0 s for every prompt it knew, no recent values (the fallback is 0)."""
    if state.get("version") != 1:
        return state
    return {**state, "version": STATE_VERSION, "env": [0.0] * len(state.get("prompt_ids", [])),
            "recent_env": []}


class LengthPredictor:
    """EWMA length predictor keyed by ``prompt_id``; see the module docstring for call order.

    ``alpha`` is the weight of the newest observation (1.0 keeps only the last epoch's length);
    ``fallback_quantile`` picks the quantile of recent per-prompt lengths used for unseen
    prompts; ``window`` bounds how many recent per-prompt observations that quantile uses.
    """

    def __init__(
        self,
        alpha: float = 0.5,
        fallback_quantile: float = 0.5,
        default_length: float = 128.0,
        window: int = 4096,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"LengthPredictor: alpha={alpha!r}; allowed: 0 < alpha <= 1")
        if not 0.0 <= fallback_quantile <= 1.0:
            raise ValueError(
                f"LengthPredictor: fallback_quantile={fallback_quantile!r}; allowed: [0, 1]"
            )
        if not (np.isfinite(default_length) and default_length >= 0):
            raise ValueError(
                f"LengthPredictor: default_length={default_length!r}; allowed: finite, >= 0"
            )
        if int(window) != window or window < 1:
            raise ValueError(f"LengthPredictor: window={window!r}; allowed: an integer >= 1")
        self.alpha = float(alpha)
        self.fallback_quantile = float(fallback_quantile)
        self.default_length = float(default_length)
        self.window = int(window)
        self._index: dict[str, int] = {}
        self._ids: list[str] = []
        self._mean = np.zeros(0)
        self._max = np.zeros(0)
        self._env = np.zeros(0)
        self._count = np.zeros(0, dtype=np.int64)
        self._recent_mean = np.zeros(0)
        self._recent_max = np.zeros(0)
        self._recent_env = np.zeros(0)

    def __len__(self) -> int:
        """Number of distinct prompts observed so far."""
        return len(self._ids)

    def _lookup(self, prompt_ids: Sequence[str]) -> np.ndarray:
        get = self._index.get
        return np.fromiter((get(p, -1) for p in prompt_ids), dtype=np.int64, count=len(prompt_ids))

    def _fallback(self, recent: np.ndarray, default: float) -> float:
        if recent.size == 0:
            return default
        return float(np.quantile(recent, self.fallback_quantile))

    def _predict(self, prompt_ids: Sequence[str], table: np.ndarray, recent: np.ndarray,
                 default: float | None = None) -> np.ndarray:
        idx = self._lookup(prompt_ids)
        fallback = self._fallback(recent, self.default_length if default is None else default)
        out = np.full(idx.size, fallback)
        seen = idx >= 0
        out[seen] = table[idx[seen]]
        return out

    def predict(self, prompt_ids: Sequence[str]) -> np.ndarray:
        """Predicted mean response length (tokens) of each prompt's samples, shape [len(ids)].

        May be called any time; it never changes state. Unseen prompts get the fallback.
        """
        return self._predict(prompt_ids, self._mean, self._recent_mean)

    def predict_max(self, prompt_ids: Sequence[str]) -> np.ndarray:
        """Predicted longest sample (tokens) of each prompt's group, shape [len(ids)]."""
        return self._predict(prompt_ids, self._max, self._recent_max)

    def predict_env(self, prompt_ids: Sequence[str]) -> np.ndarray:
        """Predicted seconds outside the model of each of the prompt's episodes (its
        environment's calls, its agent's own code), shape [len(ids)]; 0 before any was
        observed."""
        return self._predict(prompt_ids, self._env, self._recent_env, default=0.0)

    def error(self, prompt_ids: Sequence[str], lengths: Sequence[int],
              env_seconds: Sequence[float] | None = None) -> dict[str, Any]:
        """Score the current predictions against measured lengths; does not change state.

        Takes one entry per sample, like ``observe``, and must be called *before* ``observe``
        with the same lengths. Returns JSON-able floats over prompts: ``mae``, ``mape``
        (|pred - actual| / max(actual, 1)), ``bias`` (mean of pred - actual; positive means
        over-prediction), the same three for the group max (``*_max``) and, given
        ``env_seconds``, for the seconds outside the model (``*_env``: of the mean over a
        prompt's samples, ``mape_env`` against at least 1 s), and counts. Metrics are
        ``None`` when no lengths are given.
        """
        where = "LengthPredictor.error"
        values = _per_sample(prompt_ids, lengths, where)
        env = _env_per_sample(prompt_ids, env_seconds, where)
        suffixes = ("", "_max", "_env") if env_seconds is not None else ("", "_max")
        record: dict[str, Any] = {"n_samples": int(values.size)}
        if values.size == 0:
            names = [m + s for s in suffixes for m in ("mae", "mape", "bias")]
            return record | {"n_prompts": 0, "n_unseen": 0} | dict.fromkeys(names)
        keys, means, maxes, env_means = _group(prompt_ids, values, env)
        record["n_prompts"] = len(keys)
        record["n_unseen"] = int(np.count_nonzero(self._lookup(keys) < 0))
        scored = {"": (self.predict, means), "_max": (self.predict_max, maxes),
                  "_env": (self.predict_env, env_means)}
        for suffix in suffixes:
            predict, actual = scored[suffix]
            diff = predict(keys) - actual
            record["mae" + suffix] = float(np.mean(np.abs(diff)))
            record["mape" + suffix] = float(np.mean(np.abs(diff) / np.maximum(actual, 1.0)))
            record["bias" + suffix] = float(np.mean(diff))
        return record

    def observe(self, prompt_ids: Sequence[str], lengths: Sequence[int],
                env_seconds: Sequence[float] | None = None) -> None:
        """Fold one iteration's measured response lengths (and ``env_seconds``, each
        sample's seconds outside the model; none given: 0) into the per-prompt EWMAs.

        ``prompt_ids[j]``, ``lengths[j]`` and ``env_seconds[j]`` describe sample j; a prompt's
        samples are first reduced to the mean and max length and the mean seconds, which then
        update that prompt's three EWMAs (the first observation of a prompt sets them). Call
        once per iteration, after ``error``.
        """
        where = "LengthPredictor.observe"
        values = _per_sample(prompt_ids, lengths, where)
        env = _env_per_sample(prompt_ids, env_seconds, where)
        if values.size == 0:
            return
        keys, means, maxes, env_means = _group(prompt_ids, values, env)
        idx = self._lookup(keys)
        new = idx < 0
        if new.any():
            start = len(self._ids)
            new_keys = [k for k, is_new in zip(keys, new, strict=True) if is_new]
            self._index.update((k, start + i) for i, k in enumerate(new_keys))
            self._ids.extend(new_keys)
            idx[new] = np.arange(start, start + len(new_keys))
            grow = len(new_keys)
            self._mean = np.concatenate([self._mean, np.zeros(grow)])
            self._max = np.concatenate([self._max, np.zeros(grow)])
            self._env = np.concatenate([self._env, np.zeros(grow)])
            self._count = np.concatenate([self._count, np.zeros(grow, dtype=np.int64)])
        first = self._count[idx] == 0
        a = np.where(first, 1.0, self.alpha)
        self._mean[idx] = a * means + (1.0 - a) * self._mean[idx]
        self._max[idx] = a * maxes + (1.0 - a) * self._max[idx]
        self._env[idx] = a * env_means + (1.0 - a) * self._env[idx]
        self._count[idx] += 1
        self._recent_mean = np.concatenate([self._recent_mean, means])[-self.window :]
        self._recent_max = np.concatenate([self._recent_max, maxes])[-self.window :]
        self._recent_env = np.concatenate([self._recent_env, env_means])[-self.window :]

    def state_dict(self) -> dict[str, Any]:
        """Learned state as plain lists and floats (JSON- and zarr-attribute friendly).

        Hyperparameters are included for the record; ``load_state_dict`` keeps the ones this
        predictor was constructed with, so a resumed run may change ``alpha``.
        """
        return {
            "version": STATE_VERSION,
            "alpha": self.alpha,
            "fallback_quantile": self.fallback_quantile,
            "default_length": self.default_length,
            "window": self.window,
            "prompt_ids": list(self._ids),
            "mean": self._mean.tolist(),
            "max": self._max.tolist(),
            "env": self._env.tolist(),
            "count": self._count.tolist(),
            "recent_mean": self._recent_mean.tolist(),
            "recent_max": self._recent_max.tolist(),
            "recent_env": self._recent_env.tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the learned state with ``state`` from ``state_dict`` (of this version or
        version 1); validates it first."""
        where = "LengthPredictor.load_state_dict"
        state = _upgraded(state)
        keys = ("version", "prompt_ids", "mean", "max", "env", "count", "recent_mean",
                "recent_max", "recent_env")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"{where}: state lacks keys {missing}; expected those of state_dict()")
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"{where}: state version {state['version']!r}; this code reads 1 and "
                f"{STATE_VERSION}"
            )
        ids = [str(p) for p in state["prompt_ids"]]
        mean, mx, env = (np.asarray(state[k], dtype=np.float64).reshape(-1)
                         for k in ("mean", "max", "env"))
        count = np.asarray(state["count"], dtype=np.int64).reshape(-1)
        if not (len(ids) == mean.size == mx.size == env.size == count.size):
            raise ValueError(
                f"{where}: prompt_ids, mean, max, env and count have lengths "
                f"{len(ids)}, {mean.size}, {mx.size}, {env.size}, {count.size}; "
                "they must be equal"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"{where}: prompt_ids contains duplicates; each prompt appears once")
        self._ids = ids
        self._index = {p: i for i, p in enumerate(ids)}
        self._mean, self._max, self._env, self._count = mean, mx, env, count
        self._recent_mean, self._recent_max, self._recent_env = (
            np.asarray(state[k], dtype=np.float64)[-self.window :]
            for k in ("recent_mean", "recent_max", "recent_env"))


def remaining_tokens(pred_max: np.ndarray | float, generated: np.ndarray | float,
                     cap: float | None = None) -> np.ndarray:
    """Predicted tokens still to decode for unfinished sequences, conditioned on what each
    has generated: the group's predicted longest sample minus ``generated`` while it lies
    ahead; past it, as many again as generated (a sequence that outran its prediction is
    in the heavy tail, where the expected remainder grows with the time already spent),
    never beyond the response cap ``cap``; at least 1."""
    pmax = np.asarray(pred_max, dtype=np.float64)
    gen = np.asarray(generated, dtype=np.float64)
    rem = np.where(gen < pmax, pmax - gen, gen)
    if cap is not None:
        rem = np.minimum(rem, cap - gen)
    return np.maximum(rem, 1.0)
