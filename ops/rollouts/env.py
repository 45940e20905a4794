"""The environment protocol of multi-turn rollouts, and the built-in tool environments.

An ``Environment`` is one episode, Gym-style (``reset`` / ``step`` / ``close``) with text
actions and observations, as verifiers' ``MultiTurnEnv`` and TRL's ``environment_factory``
have it. ``ops/rollouts/episode.py`` drives it; see ``Environment`` for the call order.

``ToolEnvironment`` is the common case: the model calls tools in the OpenAI function-call
style (``ops/rollouts/tools.py``); a turn with tool calls gets their results as the observation, a
turn without one is the final answer, scored by a verifier against the row's ``answer``.
Built in: ``"python"`` (``PythonToolEnv``: a sandboxed ``python`` tool) and ``"tally-tool"``
(the embedded multi-turn task, ``ops/toy/tinytool.py``). A user environment is named like a user
reward, ``"package.module:Class"``, and built with the ``env_kwargs`` of the configuration.
"""

from __future__ import annotations

import importlib
import math
import numbers
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass

from .reward import VERIFIERS
from .sandbox import SandboxLimits, run_python
from .tools import Tool, call_tool, parse_tool_calls

BUILTIN_ENVIRONMENTS = {
    "python": "rlhfless.ops.rollouts.env:PythonToolEnv",
    "tally-tool": "rlhfless.ops.toy.tinytool:TallyToolEnv",
}


@dataclass(frozen=True)
class StepResult:
    observation: str  # text appended after the model's turn (ignored when done)
    reward: float  # this step's contribution to the episode's reward
    done: bool


class Environment(ABC):
    """One episode. The rollout loop calls, in this order, each call on an environment thread
    under the step time limit (a call that raises, overruns or returns the wrong type ends
    the episode with a recorded error)::

        env = EnvClass(**env_kwargs)       one instance per episode
        text = env.reset(row)              row: the prompt row as a dict (prompt_id, answer,
                                           data_source, ... and prompt_text); text (or None)
                                           is appended after the prompt as an observation
        until done or a limit (max turns, tokens per turn / per episode):
            the model generates one turn (up to EOS)
            result = env.step(turn_text)   StepResult(observation, reward, done)
            the observation is tokenized once and appended (masked out of the loss)
        env.close()                        always, after the last step, an error or a limit

    The episode's reward is the sum of its steps' rewards."""

    @abstractmethod
    def reset(self, row: dict) -> str | None:
        """Start the episode for ``row``; return text to append to the prompt, or None."""

    @abstractmethod
    def step(self, turn: str) -> StepResult:
        """React to the model's turn (its text, as generated)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the episode held (sandboxes, connections)."""


def check_step(result: object) -> StepResult:
    """``result`` as a ``StepResult`` (a ``(observation, reward, done)`` tuple is accepted);
    ``TypeError`` naming what is wrong otherwise."""
    if isinstance(result, tuple) and len(result) == 3:
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned {type(result).__name__}, expected StepResult")
    if not isinstance(result.observation, str):
        raise TypeError(f"step observation is {type(result.observation).__name__}, not str")
    if not isinstance(result.reward, numbers.Real) or not math.isfinite(float(result.reward)):
        raise TypeError(f"step reward {result.reward!r} is not a finite number")
    if not isinstance(result.done, bool):
        raise TypeError(f"step done is {type(result.done).__name__}, not bool")
    return result


def resolve_environment(name: str) -> type[Environment]:
    """A built-in environment by name, or a user class given as ``"module:Class"``."""
    target = BUILTIN_ENVIRONMENTS.get(name, name)
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"environment {name!r}: not one of {sorted(BUILTIN_ENVIRONMENTS)} "
                         "or 'module:Class'")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {name!r} is not a subclass of ops.rollouts.env.Environment")
    return cls


class ToolEnvironment(Environment):
    """Tool use: a turn with ``<tool_call>``s gets their results back, one
    ``response_format`` each, then ``next_turn`` (the cue for the model's next turn); a turn
    without one ends the episode, scored by ``VERIFIERS[verifier](turn, row["answer"])``."""

    response_format = "<tool_response>{}</tool_response>\n"
    next_turn = ""
    verifier = "exact"

    def __init__(self) -> None:
        self.row: dict = {}

    @abstractmethod
    def tools(self) -> list[Tool]:
        """The tools of this episode (called after ``reset`` set ``self.row``)."""

    def reset(self, row: dict) -> str | None:
        self.row = row
        self._tools = {t.name: t for t in self.tools()}
        return None

    def step(self, turn: str) -> StepResult:
        calls = parse_tool_calls(turn)
        if not calls:
            return StepResult("", VERIFIERS[self.verifier](turn, self.row.get("answer")), True)
        results = [call_tool(self._tools, call) for call in calls]
        return StepResult("".join(self.response_format.format(r) for r in results)
                          + self.next_turn, 0.0, False)


class PythonToolEnv(ToolEnvironment):
    """A ``python`` tool that runs code in a sandbox directory of its own per episode
    (``ops/rollouts/sandbox.run_python``: its own namespaces as uid 65534, limits on its process
    tree); the final answer is checked with the math verifier."""

    verifier = "math"

    def __init__(self, wall_s: float = 5.0, cpu_s: int = 2, memory_mb: int = 512,
                 disk_mb: int = 64, processes: int = 64,
                 sandbox_root: str | None = None) -> None:
        super().__init__()
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_bytes=memory_mb * 2**20,
                                    disk_bytes=disk_mb * 2**20, processes=processes)
        self.sandbox = tempfile.mkdtemp(prefix="rlhfless-sandbox-", dir=sandbox_root)

    def tools(self) -> list[Tool]:
        return [Tool("python", "Run Python code; returns what it prints.",
                     {"type": "object", "properties": {"code": {"type": "string"}},
                      "required": ["code"]},
                     lambda code: run_python(code, self.sandbox, self.limits).text())]

    def close(self) -> None:
        shutil.rmtree(self.sandbox, ignore_errors=True)
