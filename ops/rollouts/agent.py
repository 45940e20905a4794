"""Agent episodes: user code that calls an OpenAI- or Anthropic-compatible endpoint, trained
token-exact.

``agent = "module:function"`` names a function ``agent(client, row, model) -> reward``: an
``openai.OpenAI`` client set up for its episode (the worker's endpoint, the episode's own
key), the prompt's row (every dataset column, ``prompt_text`` among them) and the model
name. ``run_agent_episodes`` runs one episode per (prompt, sample) of a shard in child
processes (``agent_process.py``: ``processes`` per shard, kept from one shard to the next
or started ahead, so their imports are done when the episodes start; every episode on a
thread of one, each under ``timeout_s``), while the worker's endpoint
(``agent_server.py``) serves their requests from the engine in batches. ``agent =
"http://host:port/path"`` (or ``https://``) is an agent service of the user's own instead:
each episode is POSTed to it (``agent_http.py``) under the same limit and failure rules.
What the episode becomes is built from the requests as the server recorded them, never
from text:

* a **linear conversation** (each request's prompt ids start with the previous request's
  prompt ids and the sample it got) is one trajectory: the first prompt, then each sample's
  ids (trained: ``loss_mask`` 1, with behaviour logprobs) and the ids the agent added before
  its next request (tool results, its own messages: ``loss_mask`` 0);
* a request that does not extend the conversation (a sub-agent, a retry, a branch, a
  sample of ``n > 1`` beyond the first) starts a trajectory of its own; every trajectory of
  the episode carries the episode's reward;
* an agent that raises, overruns its limit, returns no finite number or never calls the
  model ends its episode as an error (``env_error``; ``finish_reason = "error"``), never the
  shard.

Each row's ``env_seconds`` is the episode's time outside the model (its wall time less the
seconds its requests took), beside the model seconds in ``GenerationStats``. The shard's
``env_wait_seconds`` is the time its engine sampled nothing while its agents ran (the
shard's wall time less the endpoint's busy seconds): the worker-seconds the agents cost
beyond the model's, which the iteration record bills apart (``env_wait_worker_s``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from ..data.records import record_fields
from ..data.schema import EPISODES
from ..engine import phases
from ..engine.engine_types import SamplingParams
from ..engine.gen_stats import EpisodeStats, GenerationStats
from ..engine.protocol import GenerationBackend
from ..engine.rows import expand_samples, rollouts_table, row_keys
from .agent_binding import AGENT_HOSTS, endpoint_binding
from .agent_http import check_agent_url, is_agent_url, post_episodes
from .agent_process import run_in_processes

if TYPE_CHECKING:  # the endpoint (FastAPI, uvicorn) is imported where an agent runs
    from .agent_server import AgentEndpoint, Call

_ENDPOINT: dict[str, AgentEndpoint] = {}  # this process's endpoint per agent_host, on first use


@dataclass(frozen=True)
class AgentParams:
    agent: str  # "module:function", or an agent service's URL (agent_http.py)
    timeout_s: float = 60.0  # per episode, from its start
    concurrency: int = 64  # episodes at once in the shard's agent processes
    chat_template: str | None = None  # None: the tokenizer's
    host: str = "loopback"  # where the endpoint listens: loopback or worker (agent_binding.py)
    service_ca: str | None = None  # PEM: the agent service's only authority (agent_http.py)
    processes: int = 2  # agent processes a shard's episodes are spread over (agent_process.py)

    def __post_init__(self) -> None:
        if is_agent_url(self.agent):
            check_agent_url(self.agent)
        elif ":" not in self.agent:
            raise ValueError(f"agent = {self.agent!r}: use 'module:function' or an "
                             "http(s):// URL")
        if self.host not in AGENT_HOSTS:
            raise ValueError(f"agent host = {self.host!r}: allowed {AGENT_HOSTS}")
        if not self.timeout_s > 0 or self.concurrency < 1 or self.processes < 1:
            raise ValueError("agent timeout_s must be > 0, concurrency and processes >= 1")


@dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    finish: str
    calls: int


def endpoint(host: str = "loopback") -> AgentEndpoint:
    """This process's agent endpoint on ``host`` (``AGENT_HOSTS``), started on the first call."""
    if host not in _ENDPOINT:
        from .agent_server import AgentEndpoint

        server = AgentEndpoint()
        server.start(endpoint_binding(host))
        _ENDPOINT[host] = server
    return _ENDPOINT[host]


def trajectories(calls: list[Call]) -> list[Trajectory]:
    """The episode's trajectories from its requests in order (see the module docstring)."""
    out: list[Trajectory] = []
    for call in calls:
        for s, (ids, logprobs, finish) in enumerate(call.samples):
            whole = None
            if s == 0:
                whole = next((t for t in reversed(out)
                              if _extends(call.prompt_ids, t)), None)
            if whole is None:
                out.append(Trajectory(list(call.prompt_ids), list(ids), list(logprobs),
                                      [1] * len(ids), finish, 1))
                continue
            added = call.prompt_ids[len(whole.prompt_ids) + len(whole.ids):]
            whole.ids += added + list(ids)
            whole.logprobs += [0.0] * len(added) + list(logprobs)
            whole.mask += [0] * len(added) + [1] * len(ids)
            whole.finish, whole.calls = finish, whole.calls + 1
    return out


def _extends(prompt: list[int], t: Trajectory) -> bool:
    so_far = t.prompt_ids + t.ids
    return len(prompt) >= len(so_far) and prompt[:len(so_far)] == so_far


def play_agents(engine: GenerationBackend, rows: pa.Table, sampling: SamplingParams,
                params: AgentParams, stats: GenerationStats) -> list[tuple[dict, list[Call]]]:
    """One agent episode per row (``expand_samples``' rows) on ``engine``: each episode's
    outcome (``{"reward"}`` or ``{"error"}``, with ``"seconds"``) and its requests as the
    endpoint recorded them."""
    server = endpoint(params.host)
    server.set_engine(engine, sampling, params.chat_template)
    server.stats, server.concurrency = stats, params.concurrency
    texts = engine.tokenizer.batch_decode(rows.column("prompt_ids").to_pylist(),
                                          skip_special_tokens=True) if len(rows) else []
    tokens = [server.open_episode(int(k)) for k in row_keys(sampling.seed, rows)]
    episodes = [{"api_key": t, "row": _plain(record_fields(r) | {"prompt_text": text})}
                for t, r, text in zip(tokens, rows.to_pylist(), texts)]
    try:
        outcomes = _run_agents(params, server, episodes)
    finally:
        records = [server.close_episode(t) for t in tokens]
    return list(zip(outcomes, records))


def run_agent_episodes(engine: GenerationBackend, prompts: pa.Table, n_samples: int,
                       sampling: SamplingParams, params: AgentParams, *,
                       worker: str = "local",
                       stats: GenerationStats | None = None) -> tuple[pa.Table, EpisodeStats]:
    """The shard's agent episodes as rows: the ``ROLLOUTS`` columns (``prompt_ids`` the
    first request's, ``response_ids`` the rest of the trajectory) plus ``schema.EPISODES``;
    one row per trajectory, so an episode of several gives several rows of its prompt."""
    stats = stats if stats is not None else GenerationStats()
    server = endpoint(params.host)
    server.busy_spans = []
    rows, start = expand_samples(prompts, n_samples), time.time()
    busy, wall = server.busy_s, time.perf_counter()
    played = play_agents(engine, rows, sampling, params, stats)
    idle = time.perf_counter() - wall - (server.busy_s - busy)
    record_waits(start, time.time(), server.busy_spans)
    return agent_rows(rows, played, engine, worker=worker, start=start, idle_s=max(idle, 0.0))


def record_waits(start: float, end: float, busy: list[tuple[float, float]]) -> None:
    """The trace's ``agent_wait`` spans: the gaps in ``[start, end]`` between the engine's
    calls ``busy`` ((start, end) wall times, one server thread: never overlapping), when the
    engine sampled nothing while the agents ran."""
    cursor = start
    for t0, t1 in sorted(busy) + [(end, end)]:
        if t0 > cursor:
            phases.record("agent_wait", cursor, t0)
        cursor = max(cursor, t1)


def agent_rows(rows: pa.Table, played: list[tuple[dict, list[Call]]],
               engine: GenerationBackend, *, worker: str, start: float,
               idle_s: float = 0.0) -> tuple[pa.Table, EpisodeStats]:
    """The table of ``run_agent_episodes`` from ``play_agents``' episodes of ``rows``;
    ``idle_s``: the seconds the engine sampled nothing while they ran."""
    out_rows, results, extra, est = [], [], [], EpisodeStats(env_wait_seconds=idle_s)
    per_prompt: dict[str, int] = {}
    for row, (outcome, calls) in zip(rows.to_pylist(), played):
        error = outcome.get("error")
        if error is None and not calls:
            error = "the agent never called the model"
        model_s = sum(c.seconds for c in calls)
        agent_s = max(0.0, float(outcome.get("seconds", 0.0)) - model_s)
        reward = 0.0 if error is not None else float(outcome["reward"])
        found = trajectories(calls) or [Trajectory(row["prompt_ids"], [], [], [], "error", 0)]
        est.episodes += 1
        est.env_errors += error is not None
        est.env_seconds += agent_s
        est.env_calls += len(calls)
        for t in found:
            sample = per_prompt.get(row["prompt_id"], 0)
            per_prompt[row["prompt_id"]] = sample + 1
            out_rows.append(row | {"prompt_ids": t.prompt_ids, "sample_idx": sample})
            results.append((t.ids, t.logprobs, "error" if error is not None else t.finish))
            extra.append((t.mask, t.calls, reward, error, agent_s))
            est.turns += t.calls
            est.observation_tokens += t.mask.count(0)
    table = rollouts_table(pa.Table.from_pylist(out_rows, schema=rows.schema), results,
                           engine.tokenizer, policy_version=engine.version, worker=worker,
                           start=start, end=time.time())
    columns = {
        "loss_mask": pa.array([e[0] for e in extra], pa.list_(pa.int8())),
        "turns": pa.array([e[1] for e in extra], pa.int32()),
        "env_reward": pa.array([e[2] for e in extra], pa.float64()),
        "turn_rewards": pa.array([[] for _ in extra], pa.list_(pa.float64())),
        "env_error": pa.array([e[3] for e in extra], pa.string()),
        "env_seconds": pa.array([e[4] for e in extra], pa.float64()),
    }
    for name, column in columns.items():
        table = table.append_column(EPISODES.field(name), column)
    return table, est


def _plain(row: dict) -> dict:
    """The row as JSON can carry it (bytes and other odd values as text)."""
    return json.loads(json.dumps(row, default=str))


def _run_agents(params: AgentParams, server: AgentEndpoint, episodes: list[dict]) -> list[dict]:
    """Every episode's outcome (``{"reward"}`` or ``{"error"}``, with ``"seconds"``) from the
    agent service, or from the shard's agent processes (``agent_process.py``)."""
    if not episodes:
        return []
    shared = {"base_url": server.base_url, "ca_pem": server.binding.ca_pem,
              "model": server.model_name, "timeout_s": params.timeout_s}

    def ended(i: int) -> None:
        server.end_episode(episodes[i]["api_key"])

    if is_agent_url(params.agent):
        return post_episodes(params.agent, shared, episodes, params.concurrency, ended,
                             params.service_ca)
    return run_in_processes(params.agent, shared, episodes, params.concurrency,
                            params.processes, ended)
