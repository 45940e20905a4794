"""An OpenAI- and Anthropic-compatible endpoint on a generation worker, served from its
engine, for agents.

``AgentEndpoint`` serves ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/responses`` (OpenAI's Responses API: ``agent_responses.py``), ``POST /v1/messages``
(Anthropic's Messages API: ``agent_messages.py``) and ``GET /v1/models`` (each API's request,
response and error shapes; FastAPI on uvicorn, in a thread of
the worker's process, bound to loopback by default, or to the worker's own address over
HTTPS when the cluster speaks TLS: ``agent_binding.py``). Each episode gets its own bearer
key (``open_episode``), sent as a bearer token (or, to ``/v1/messages``, as ``x-api-key``); a
request without a key that is open gets 401 and nothing else, and a key stops working when its
episode is closed. A Responses or Messages request is served as the chat request it amounts
to: templated, continued, sampled and recorded as the same conversation sent as chat, so an
episode's record does not depend on the API its agent spoke.

Requests of all open episodes are batched: a dispatcher thread takes what arrives after
the first until every episode that can send one has (the episodes the agent process runs at
once, ``concurrency``, less those that ended: ``end_episode``), or ``batch_window_s`` after
the first at the latest, and samples it in one ``decode_turns`` call of the engine protocol
(``ops/engine/protocol.py``), so concurrent agents decode together as rollouts do, at the
weights the task set. Every request is recorded token-exact as the server saw it
(``Call``: the prompt ids after the chat template, each sample's ids, behaviour logprobs
and finish reason, and its seconds); ``close_episode`` hands the record back.
``n`` samples of a request are drawn under their own keys, derived from the episode's key
and the samples drawn before, so an episode replays the same draws on the same engine.
``stream: true`` is served as server-sent events of the whole response, sampled and recorded
as the same request unstreamed (``agent_stream.py``).

An episode keeps what the engine kept of its latest request (``Turn.cache``: the first
sample's conversation, as ``decode_turns(keep_cache=True)`` keeps a multi-turn episode's),
and its next request starts from it: on our engine it runs only the ids the kept KV does not
hold (the request's ids after the longest prefix they share with the last request's prompt
and sample), so an agent's conversation is prefilled once, as an environment's is. The kept
state is the engine's at its weights: a request under other weights, or of another engine,
starts afresh; it is dropped when the episode ends. ``tool_choice`` other than "auto" /
"none" is accepted but not enforced.
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.engine_types import SamplingParams, Turn
from ..engine.gen_stats import GenerationStats
from ..engine.protocol import GenerationBackend
from ..engine.seeds import subkeys
from . import agent_messages, agent_responses
from .agent_binding import Binding
from .agent_render import (
    BadRequest,
    assistant_message,
    chat_prompt_ids,
    completion_prompt_ids,
    continued_prompt_ids,
    cut_at_stop,
)
from .agent_stream import include_usage, named_events, server_sent_events, stream_chunks


@dataclass
class Call:
    """One request as the server saw it: prompt ids, and per sample (ids, logprobs, finish)."""

    prompt_ids: list[int]
    samples: list[tuple[list[int], list[float], str]]
    seconds: float


@dataclass
class _Episode:
    key: int  # the episode's sampling key
    calls: list[Call] = field(default_factory=list)
    drawn: int = 0  # samples drawn so far (each draws under subkeys(key, drawn))
    ended: bool = False  # its agent returned: it sends nothing more
    # the last chat request: its messages, prompt ids, and each answer with its sampled ids
    chat: tuple[list[dict], list[int], list[tuple[dict, list[int]]]] | None = None
    # what the engine kept of the latest request's conversation (``Turn.cache``), and the
    # engine and weights version it was kept at
    kept: tuple[Any, int, Any] | None = None


@dataclass
class _Job:
    turns: list[Turn]
    params: SamplingParams
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


class AgentEndpoint:
    """See the module docstring. ``start`` once per process; ``open_episode`` / ``close_episode``
    around each agent episode; ``set_engine`` before each task (its weights, its sampling)."""

    def __init__(self, model_name: str = "rlhfless", batch_window_s: float = 0.05) -> None:
        self.model_name, self.batch_window_s = model_name, batch_window_s
        self.concurrency = 1  # episodes the agent process runs at once
        self._live = 0  # open episodes that have not ended
        self.engine: GenerationBackend | None = None
        self.sampling = SamplingParams()
        self.chat_template: str | None = None
        self.threads = 1
        self.stats = GenerationStats()
        self.busy_s = 0.0  # seconds the engine spent sampling for requests, ever
        self.busy_spans: list[tuple[float, float]] = []  # (start, end) wall times of each
        # engine call since the shard's episodes began (``agent.run_agent_episodes``)
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._server: Any = None
        self.binding = Binding()
        self.base_url = ""

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self, binding: Binding | None = None) -> str:
        """Serve on a free port of ``binding`` (default: loopback, plain HTTP); returns the
        base URL (``http://127.0.0.1:<port>/v1``, ``https://<worker host>:<port>/v1``)."""
        import uvicorn
        from distributed.comm.addressing import unparse_host_port

        self.binding = binding or Binding()
        tls = self.binding.tls
        config = uvicorn.Config(build_app(self), host=self.binding.host, port=0,
                                log_level="error", lifespan="off", access_log=False,
                                ssl_context_factory=None if tls is None else lambda *_: tls)
        self._server = uvicorn.Server(config)
        self._serving = threading.Thread(target=self._server.run, name="rlhfless-endpoint",
                                         daemon=True)
        self._serving.start()
        threading.Thread(target=self._dispatch, name="rlhfless-endpoint-batch",
                         daemon=True).start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the agent endpoint did not start within 30 s")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        host_port = unparse_host_port(self.binding.host, port)
        self.base_url = f"{self.binding.scheme}://{host_port}/v1"
        return self.base_url

    def stop(self) -> None:
        """Stop serving, dropping open connections; its port is closed when this returns."""
        if self._server is not None:
            self._server.should_exit = self._server.force_exit = True
            self._jobs.put(None)
            self._serving.join(10)
            self._server = None

    def set_engine(self, engine: GenerationBackend, sampling: SamplingParams,
                   chat_template: str | None) -> None:
        """Serve from ``engine`` with the task's ``sampling``; the engine runs on the
        dispatcher thread with the calling thread's torch threads (OpenMP's count is each
        thread's own, and vLLM's CPU attention checks it against its load's)."""
        self.engine, self.sampling, self.chat_template = engine, sampling, chat_template
        self.threads = torch.get_num_threads()

    def open_episode(self, key: int) -> str:
        """A new episode drawing under sampling ``key``; returns its bearer key."""
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._episodes[token] = _Episode(int(key))
            self._live += 1
        return token

    def end_episode(self, token: str) -> None:
        """The episode's agent returned: the batcher waits for its requests no more."""
        with self._lock:
            episode = self._episodes.get(token)
            if episode is not None and not episode.ended:
                episode.ended, episode.kept = True, None
                self._live -= 1

    def close_episode(self, token: str) -> list[Call]:
        """The episode's calls in order; its key stops working."""
        self.end_episode(token)
        with self._lock:
            episode = self._episodes.pop(token, None)
        return [] if episode is None else episode.calls

    def _senders(self) -> int:
        """How many requests can be on their way: one per episode running now."""
        with self._lock:
            return min(self.concurrency, self._live)

    def episode_of(self, authorization: str | None, api_key: str | None = None) \
            -> _Episode | None:
        """The open episode whose key is the bearer token of ``authorization``, or
        ``api_key``."""
        if authorization and authorization.startswith("Bearer "):
            api_key = authorization[len("Bearer "):].strip()
        if not api_key:
            return None
        with self._lock:
            return self._episodes.get(api_key)

    # ---- sampling ----------------------------------------------------------------------

    async def sample(self, episode: _Episode, prompt_ids: list[int], body: dict) -> Call:
        """Sample the request ``body`` asks for on ``prompt_ids``; records and returns it."""
        engine = self.engine
        if engine is None:
            raise BadRequest("no engine is serving (no agent task is running)")
        n = int(body.get("n") or 1)
        if not 1 <= n <= 64:
            raise BadRequest(f"n = {n}: allowed 1 to 64")
        limit = engine.max_context or (len(prompt_ids) + self.sampling.max_new_tokens)
        want = body.get("max_tokens") or body.get("max_completion_tokens") \
            or self.sampling.max_new_tokens
        budget = min(int(want), limit - len(prompt_ids))
        if budget < 1:
            raise BadRequest(f"the prompt is {len(prompt_ids)} tokens: no room left in the "
                             f"model's context of {limit}")
        temperature = body.get("temperature")
        params = replace(self.sampling, max_new_tokens=budget,
                         greedy=self.sampling.greedy or temperature == 0,
                         temperature=float(temperature) if temperature else
                         self.sampling.temperature,
                         top_p=float(body.get("top_p") or self.sampling.top_p))
        with self._lock:
            keys = subkeys(np.full(n, episode.key, dtype=np.uint64),
                           np.arange(episode.drawn, episode.drawn + n, dtype=np.uint64))
            episode.drawn += n
            kept = episode.kept
        cache = kept[2] if kept is not None and kept[:2] == (engine, engine.version) else None
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        job = _Job([Turn(list(prompt_ids), budget, int(k), cache) for k in keys], params,
                   loop.create_future(), loop)
        self._jobs.put(job)
        samples = await job.done
        with self._lock:
            if not episode.ended:
                episode.kept = (engine, engine.version, job.turns[0].cache)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        samples = [cut_at_stop(engine.tokenizer, *s, stop) for s in samples]
        call = Call(list(prompt_ids), samples, time.perf_counter() - started)
        with self._lock:
            episode.calls.append(call)
        return call

    def _dispatch(self) -> None:
        """The batching thread: the requests of every running episode, or those that arrived
        within the window, one engine call per sampling parameters."""
        while (first := self._jobs.get()) is not None:
            jobs = [first]
            deadline = time.perf_counter() + self.batch_window_s
            while len(jobs) < self._senders() and (left := deadline - time.perf_counter()) > 0:
                try:  # woken often: an episode that ends sends nothing to wake it
                    job = self._jobs.get(timeout=min(left, 0.002))
                except queue.Empty:
                    continue
                if job is None:
                    self._jobs.put(None)
                    break
                jobs.append(job)
            groups: dict[SamplingParams, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(replace(job.params, max_new_tokens=1), []).append(job)
            for group in groups.values():
                self._run(group)

    def _run(self, jobs: list[_Job]) -> None:
        turns = [t for job in jobs for t in job.turns]
        params = replace(jobs[0].params,
                         max_new_tokens=max(t.budget for t in turns))
        started, at = time.perf_counter(), time.time()
        try:
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            self.engine.decode_turns(turns, params, self.stats, keep_cache=True)
            outcome: Any = None
        except BaseException as err:  # the request fails, the server goes on
            outcome = err
        self.busy_s += time.perf_counter() - started
        self.busy_spans.append((at, time.time()))
        for job in jobs:
            if outcome is None:
                value = [t.result for t in job.turns]
                job.loop.call_soon_threadsafe(_settle, job.done, value, None)
            else:
                job.loop.call_soon_threadsafe(_settle, job.done, None, outcome)


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def build_app(endpoint: AgentEndpoint):
    """The FastAPI application of ``endpoint``."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def openai_error(status: int, message: str) -> JSONResponse:
        code = "invalid_api_key" if status == 401 else "bad_request"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                       "code": code}}, status_code=status)

    def anthropic_error(status: int, message: str) -> JSONResponse:
        kind = "authentication_error" if status == 401 else "invalid_request_error"
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                            status_code=status)

    def tokenizer():
        if endpoint.engine is None:
            raise BadRequest("no engine is serving (no agent task is running)")
        return endpoint.engine.tokenizer

    async def served(request: Request, answer, stream, error=openai_error,
                     api_key: str | None = None) -> JSONResponse | StreamingResponse:
        """``answer(episode, body)`` gives the response and its ``Call``; ``stream(response,
        call, body)`` its server-sent events when the body asks for a stream."""
        episode = endpoint.episode_of(request.headers.get("authorization"), api_key)
        if episode is None:
            return error(401, "no valid key for an open episode")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            response, call = await answer(episode, body)
            if not body.get("stream"):
                return JSONResponse(response)
            return StreamingResponse(stream(response, call, body),
                                     media_type="text/event-stream")
        except BadRequest as err:
            return error(400, str(err))
        except ValueError as err:  # malformed JSON
            return error(400, f"the request body is not JSON: {err}")

    async def chat(episode: _Episode, body: dict) -> tuple[list[dict], Call]:
        """The choices (index, message, finish reason) of the chat request ``body``."""
        tok = tokenizer()
        messages = body.get("messages")
        prompt = None
        if episode.chat is not None and isinstance(messages, list):
            prompt = continued_prompt_ids(tok, messages, *episode.chat, endpoint.chat_template)
        if prompt is None:
            prompt = chat_prompt_ids(tok, messages, body.get("tools"), endpoint.chat_template)
        call = await endpoint.sample(episode, prompt, body)
        parse_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        choices = []
        for i, (ids, _, finish) in enumerate(call.samples):
            text = tok.decode(ids, skip_special_tokens=True)
            message, calls_tools = (assistant_message(text, f"call-{len(episode.calls)}-{i}")
                                    if parse_tools else ({"role": "assistant",
                                                          "content": text}, False))
            choices.append({"index": i, "message": message, "logprobs": None,
                            "finish_reason": "tool_calls" if calls_tools else finish})
        episode.chat = (list(messages), prompt,
                        [(c["message"], s[0]) for c, s in zip(choices, call.samples)])
        return choices, call

    async def chat_completion(episode: _Episode, body: dict) -> tuple[dict, Call]:
        include_usage(body)  # refused before sampling when malformed
        choices, call = await chat(episode, body)
        return _response("chat.completion", endpoint.model_name, call, choices), call

    async def completions(episode: _Episode, body: dict) -> tuple[dict, Call]:
        include_usage(body)
        tok = tokenizer()
        call = await endpoint.sample(episode, completion_prompt_ids(tok, body.get("prompt")),
                                     body)
        choices = [{"index": i, "text": tok.decode(ids, skip_special_tokens=True),
                    "logprobs": None, "finish_reason": finish}
                   for i, (ids, _, finish) in enumerate(call.samples)]
        return _response("text_completion", endpoint.model_name, call, choices), call

    def chunks(response: dict, call: Call, body: dict):
        return server_sent_events(stream_chunks(response, [ids for ids, _, _ in call.samples],
                                                tokenizer(), include_usage(body)))

    def answer_as(chat_request, build):
        """The answer of a request of another API: its ``chat_request``'s one answer, as
        ``build`` makes it that API's response."""
        async def answer(episode: _Episode, body: dict) -> tuple[dict, Call]:
            [choice], call = await chat(episode, chat_request(body))
            return build(body, endpoint.model_name, len(call.prompt_ids),
                         call.samples[0][0], choice), call
        return answer

    def events_as(events):
        return lambda response, call, body: named_events(
            events(response, call.samples[0][0], tokenizer()))

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request):
        return await served(request, chat_completion, chunks)

    @app.post("/v1/completions")
    async def completions_route(request: Request):
        return await served(request, completions, chunks)

    @app.post("/v1/responses")
    async def responses_route(request: Request):
        return await served(request, answer_as(agent_responses.chat_request,
                                             agent_responses.response_object),
                            events_as(agent_responses.response_events))

    @app.post("/v1/messages")
    async def messages_route(request: Request):
        return await served(request, answer_as(agent_messages.chat_request,
                                             agent_messages.message_object),
                            events_as(agent_messages.message_events), anthropic_error,
                            request.headers.get("x-api-key"))

    @app.get("/v1/models")
    async def models(request: Request):
        if endpoint.episode_of(request.headers.get("authorization")) is None:
            return openai_error(401, "no valid key for an open episode")
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                            "owned_by": "rlhfless"}]}

    return app


def _response(kind: str, model: str, call: Call, choices: list[dict]) -> dict:
    completion = sum(len(s[0]) for s in call.samples)
    return {"id": f"rlhfless-{secrets.token_hex(8)}", "object": kind,
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": completion,
                      "total_tokens": len(call.prompt_ids) + completion}}
