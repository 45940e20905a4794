"""Multi-turn rollouts: generation and environment steps interleaved, per sample.

``run_episodes`` plays one episode per (prompt, sample) of a shard against an environment
(``ops/rollouts/env.py``) in *rounds*. A round decodes one turn of every live episode as one batch;
an episode leaves the batch at EOS (or its token budget), and its environment step starts at
once on an environment thread, while the other episodes of the round go on decoding (the
environment's wait overlaps with their decoding). When the round's decoding is over, the
loop collects the steps, appends each observation and starts the next round.

Token ids are never re-tokenized: a trajectory is each turn's ids as sampled, EOS included,
and each observation's ids as ``tokenizer(observation)`` gave them, concatenated in order
(``response_ids``), with ``loss_mask`` 1 on generated and 0 on observation tokens. An
observation given as chat messages is rendered once through the chat template
(``render_messages``: what the template adds after a conversation, generation prompt
included) and appended the same way; the history is never rendered again. Each episode
keeps its steps' rewards (``turn_rewards``); ``env_reward`` is their sum plus the final
reward ``close()`` returned, if any.

The engine (any of the protocol's, ``ops/engine/protocol.py``) decodes each round through
``decode_turns``, which takes token ids and returns token ids: the trajectory is the same on
our decode loop and on vLLM. What an engine keeps between an episode's turns is its own
(``keep_kv``): our loop keeps each conversation's KV cache and runs only the new ids
(``ops/engine/turns.py``); vLLM's prefix cache finds the conversation's blocks again. With
``keep_kv=False`` the hf engine prefills the whole conversation every turn, which
``bench/multiturn.py`` compares against (same tokens in float64).

Limits: ``max_turns`` (then ``finish_reason = "turns"``), ``max_turn_tokens`` and
``max_episode_tokens`` (generated + observation tokens after the prompt; a turn cut short
without EOS, or an observation that would not fit, ends the episode with "length", unless
``step_cut_turns``: then a turn cut at ``max_turn_tokens`` goes to ``step`` as it is), and
``step_timeout_s`` per environment call. Every environment call (construction, ``reset``,
``step``, ``close``) runs on a thread of the process's environment pool (``ENV_THREADS``
threads, reused across shards; a thread started and ended per episode once hung a
generation worker inside CPython's thread creation) under that limit, counted from its
submission: one that raises, overruns or returns the wrong type ends that episode with
``finish_reason = "error"`` and the reason in ``env_error``, never the shard. A call that
hangs keeps its pool thread until it returns (Python threads cannot be killed); the episode
does not wait for it.

A prompt that is the environment's own first observation (``env_prompts.py``) is not
appended again: ``reset`` must give that observation again, or the episode fails.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..data.records import record_fields
from ..data.schema import EPISODES, SCORED
from ..engine.engine_types import SamplingParams, Turn
from ..engine.gen_stats import EpisodeStats, GenerationStats
from ..engine.phases import record
from ..engine.protocol import GenerationBackend
from ..engine.rows import expand_samples, rollouts_table, row_keys
from ..engine.seeds import subkeys
from .env import Environment, check_observation, check_step
from .env_prompts import PROMPT_FROM_RESET, check_replayed
from .resolve import resolve_environment
from .reward import describe_error

ENV_THREADS = 64  # environment calls in flight at once, per process
_ENV_POOL: list[ThreadPoolExecutor] = []  # made on first use, kept for the process


@dataclass(frozen=True)
class EpisodeParams:
    environment: str  # resolve.py: a name or "module:Class"; "": only the routes
    env_kwargs: dict = field(default_factory=dict)
    max_turns: int = 4
    max_turn_tokens: int = 64
    max_episode_tokens: int = 192
    step_timeout_s: float = 10.0
    keep_kv: bool = True  # False: re-prefill the conversation every turn (the baseline)
    step_cut_turns: bool = False  # True: a turn cut at max_turn_tokens still goes to step
    # data_source -> (environment, env_kwargs); a row of another source gets ``environment``
    routes: dict[str, tuple[str, dict]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_turn_tokens", "max_episode_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")


@dataclass
class _Episode:
    row: dict
    prompt: list[int]
    key: int = 0  # the sequence's sampling key; each turn draws under subkeys(key, turn)
    env: Environment | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    cache: object = None  # what the engine kept of the conversation (``Turn.cache``)
    turns: int = 0
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)  # each step's reward, in order
    error: str | None = None
    finish: str | None = None
    env_seconds: float = 0.0
    env_calls: int = 0

    def fail(self, where: str, err: BaseException) -> None:
        self.error, self.finish = f"{where}: {describe_error(err)}", "error"

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Generated ids with their logprobs, or (``logprobs`` None) observation ids."""
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)


@dataclass
class _Call:
    """An environment call in flight on the process's environment threads."""

    ep: _Episode
    future: Future
    submitted: float

    def result(self, timeout_s: float):
        """Its value, or what it raised; ``TimeoutError`` once ``timeout_s`` have passed
        since it was submitted (the call itself is abandoned, its thread runs on)."""
        left = self.submitted + timeout_s - time.perf_counter()
        try:
            return self.future.result(timeout=max(0.0, left))
        except FutureTimeout:
            self.ep.env_seconds += timeout_s
            raise TimeoutError(f"timeout after {timeout_s:g}s") from None


def _timed(ep: _Episode, fn, *args):
    started = time.perf_counter()
    try:
        return fn(*args)
    finally:
        ep.env_seconds += time.perf_counter() - started


def _env_call(ep: _Episode, fn, *args) -> _Call:
    """Start ``fn(*args)`` on an environment thread: threads are shared by the process and
    reused, so that episodes do not start and end threads all the time."""
    if not _ENV_POOL:
        _ENV_POOL.append(ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="rlhfless-env"))
    ep.env_calls += 1
    return _Call(ep, _ENV_POOL[0].submit(_timed, ep, fn, *args), time.perf_counter())


def _open(ep: _Episode, makers: dict, params: EpisodeParams):
    source = ep.row.get("data_source")
    make, kwargs = makers.get(source) or makers.get(None) or (None, None)
    if make is None:
        raise ValueError(f"data_source {source!r} has no environment (routes: "
                         f"{sorted(params.routes)}) and there is no default environment")
    ep.env = make(**kwargs)
    observation = ep.env.reset(dict(ep.row))
    if ep.row.get(PROMPT_FROM_RESET):  # the prompt is this observation (env_prompts.py)
        check_replayed(ep.row, observation)
        return None
    if observation is not None:
        check_observation(observation, "reset")
    return observation


def render_messages(tokenizer, messages: list[dict], chat_template: str | None = None) -> str:
    """Chat messages as the text the chat template (the tokenizer's, or ``chat_template``)
    puts after a conversation: the template of ``[a user turn, an assistant turn] +
    messages`` (with the generation prompt) less that of the first two. Rendered once per
    observation; the history is never rendered again."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    kwargs = {"chat_template": chat_template} if chat_template else {}
    before = tokenizer.apply_chat_template(base, tokenize=False, **kwargs)
    after = tokenizer.apply_chat_template(base + messages, tokenize=False,
                                          add_generation_prompt=True, **kwargs)
    if not after.startswith(before):
        raise ValueError("the chat template renders a conversation differently once messages "
                         "follow it; observations cannot be appended as chat messages")
    return after[len(before):]


def _observe(ep: _Episode, observation: str | list[dict] | None, tokenizer,
             params: EpisodeParams, stats: EpisodeStats) -> None:
    """Append an observation's ids as tokenized, or end the episode if it cannot fit."""
    text = (render_messages(tokenizer, observation)
            if isinstance(observation, list) and observation else observation)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    if len(ep.ids) + len(ids) >= params.max_episode_tokens:
        if not ep.ids:  # the first observation: the model would never get a turn
            ep.fail("reset", ValueError(
                f"the first observation is {len(ids)} tokens, not under max_episode_tokens "
                f"= {params.max_episode_tokens}"))
            return
        ep.finish = "length"
        return
    ep.append(ids, None)
    stats.observation_tokens += len(ids)


def run_episodes(engine: GenerationBackend, prompts: pa.Table, n_samples: int,
                 sampling: SamplingParams, params: EpisodeParams, *, worker: str = "local",
                 stats: GenerationStats | None = None) -> tuple[pa.Table, EpisodeStats]:
    """One episode per (prompt, sample), prompt-major, on ``engine`` at its version: the
    ``ROLLOUTS`` columns (the whole trajectory as ``response_ids``) plus
    ``schema.EPISODES``."""
    tokenizer = engine.tokenizer
    stats = stats if stats is not None else GenerationStats()
    est = EpisodeStats()
    makers = {source: (resolve_environment(name), kwargs)
              for source, (name, kwargs) in params.routes.items()}
    if params.environment:
        makers[None] = (resolve_environment(params.environment), params.env_kwargs)
    rows = expand_samples(prompts, n_samples)
    start = time.time()
    prompt_ids = rows.column("prompt_ids").to_pylist()
    if prompt_ids:
        engine.check_context(max(map(len, prompt_ids)) + params.max_episode_tokens)
    texts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    keys = row_keys(sampling.seed, rows).tolist()
    eps = [_Episode(_env_row(row, text, key), ids, key)
           for row, ids, text, key in zip(rows.to_pylist(), prompt_ids, texts, keys)]
    eos = tokenizer.eos_token_id
    timeout = params.step_timeout_s
    for call in [_env_call(ep, _open, ep, makers, params) for ep in eps]:
        try:
            _observe(call.ep, call.result(timeout), tokenizer, params, est)
        except BaseException as err:  # user code: recorded, this episode only
            call.ep.fail("reset", err)
    while live := [ep for ep in eps if ep.finish is None]:
        steps = _play_round(engine, live, sampling, params, eos, stats)
        waited, t0 = time.perf_counter(), time.time()
        for call in steps:
            ep = call.ep
            try:
                result = check_step(call.result(timeout))
            except BaseException as err:
                ep.fail("step", err)
                continue
            ep.reward += float(result.reward)
            ep.turn_rewards.append(float(result.reward))
            if result.done:
                ep.finish = "stop"
            elif ep.turns >= params.max_turns:
                ep.finish = "turns"
            else:
                try:
                    _observe(ep, result.observation, tokenizer, params, est)
                except ValueError as err:  # a chat template that cannot append messages
                    ep.fail("step", err)
        est.env_wait_seconds += time.perf_counter() - waited
        if steps:
            record("env_wait", t0, time.time(), episodes=len(steps))
    for call in [_env_call(ep, _close, ep.env) for ep in eps if ep.env is not None]:
        try:
            final = call.result(timeout)
            if final is not None and call.ep.finish != "error":
                call.ep.reward += _final_reward(final)
        except BaseException as err:
            if call.ep.error is None:  # the episode's result stands; the failure is recorded
                call.ep.error = f"close: {describe_error(err)}"
    for ep in eps:
        est.episodes += 1
        est.turns += ep.turns
        est.env_errors += ep.finish == "error"
        est.env_seconds += ep.env_seconds
        est.env_calls += ep.env_calls
    table = rollouts_table(rows, [(ep.ids, ep.logprobs, ep.finish) for ep in eps], tokenizer,
                           policy_version=engine.version, worker=worker, start=start,
                           end=time.time())
    return _with_episode_columns(table, eps), est


def _env_row(row: dict, prompt_text: str, key: int) -> dict:
    """What ``reset`` gets: the dataset record's fields under the row's columns, the prompt
    as text and the episode's seed (its sampling key, which the run's seed, the prompt and
    the sample fix), below 2**31 so that any library takes it."""
    return record_fields(row) | {"prompt_text": prompt_text, "episode_seed": key % 2**31}


def _close(env) -> object:
    """``env.close()`` where it has one (a duck-typed environment may not)."""
    close = getattr(env, "close", None)
    return close() if callable(close) else None


def _final_reward(value: object) -> float:
    """``close()``'s final reward as a float; ``TypeError`` unless a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
            or not np.isfinite(float(value)):
        raise TypeError(f"close returned {value!r}, expected None or a finite number")
    return float(value)


def _play_round(engine: GenerationBackend, live: list[_Episode], sampling: SamplingParams,
                params: EpisodeParams, eos: int, stats: GenerationStats) -> list[_Call]:
    """Decode one turn of every live episode; returns the environment steps started."""
    keys = subkeys(np.array([ep.key for ep in live], dtype=np.uint64),
                   np.array([ep.turns for ep in live], dtype=np.uint64))
    turns = [Turn(ep.prompt + ep.ids,
                  min(params.max_turn_tokens, params.max_episode_tokens - len(ep.ids)),
                  int(key), ep.cache) for ep, key in zip(live, keys)]
    steps: list[_Call] = []

    def on_leave(i: int, turn: list[int]) -> None:
        ep = live[i]
        if len(ep.ids) + len(turn) >= params.max_episode_tokens or (
                turn[-1] != eos and not params.step_cut_turns):
            return  # cut short: the episode ends at "length", no step
        text = engine.tokenizer.decode(turn, skip_special_tokens=True)
        steps.append(_env_call(ep, ep.env.step, text))

    engine.decode_turns(turns, sampling, stats, keep_cache=params.keep_kv, on_leave=on_leave)
    stepped = {id(call.ep) for call in steps}
    for ep, turn in zip(live, turns):
        ids, logprobs, _ = turn.result
        ep.append(ids, logprobs)
        ep.cache = turn.cache
        ep.turns += 1
        if id(ep) not in stepped:
            ep.finish = "length"
    return steps


def _with_episode_columns(table: pa.Table, eps: list[_Episode]) -> pa.Table:
    columns = {
        "loss_mask": pa.array([ep.mask for ep in eps], pa.list_(pa.int8())),
        "turns": pa.array([ep.turns for ep in eps], pa.int32()),
        "env_reward": pa.array([ep.reward for ep in eps], pa.float64()),
        "turn_rewards": pa.array([ep.turn_rewards for ep in eps], pa.list_(pa.float64())),
        "env_error": pa.array([ep.error for ep in eps], pa.string()),
        "env_seconds": pa.array([ep.env_seconds for ep in eps], pa.float64()),
    }
    for name, column in columns.items():
        table = table.append_column(EPISODES.field(name), column)
    return table


def score_episodes(rollouts: pa.Table) -> pa.Table:
    """The reward stage for episodes: each is scored by its environment (``env_reward``,
    with ``env_error`` as its ``reward_error``)."""
    table = rollouts.append_column(SCORED.field("reward"), rollouts.column("env_reward"))
    return table.append_column(SCORED.field("reward_error"), rollouts.column("env_error"))
