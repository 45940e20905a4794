"""The environment protocol of multi-turn rollouts, and the built-in tool environments.

An ``Environment`` is one episode, Gym-style (``reset`` / ``step`` / ``close``) with text
actions and observations, as verifiers' ``MultiTurnEnv`` and TRL's ``environment_factory``
have it. ``ops/rollouts/episode.py`` drives it; see ``Environment`` for the call order.

``ToolEnvironment`` is the common case: the model calls tools in the OpenAI function-call
style (``ops/rollouts/tools.py``); a turn with tool calls gets their results as the observation, a
turn without one is the final answer, scored by a verifier against the row's ``answer``.
Built in: ``"python"`` (``PythonToolEnv``: a sandboxed ``python`` tool) and ``"tally-tool"``
(the embedded multi-turn task, ``ops/toy/tinytool.py``). How a configured name becomes an
environment (built-ins, the libraries' adapters, ``"package.module:Class"``) is
``ops/rollouts/resolve.py``.
"""

from __future__ import annotations

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
# agents by name (``ops/rollouts/agent.py``), imported only where an agent episode runs
BUILTIN_AGENTS = {"tally-agent": "rlhfless.ops.toy.tinytool:tally_agent"}


Message = dict  # a chat message {"role": str, "content": str}


@dataclass(frozen=True)
class StepResult:
    # appended after the model's turn (ignored when done): text as it is, or chat messages
    # rendered once through the model's chat template (episode.render_messages)
    observation: str | list[Message]
    reward: float  # this step's contribution to the episode's reward
    done: bool


class Environment(ABC):
    """One episode. The rollout loop calls, in this order, each call on an environment thread
    under the step time limit (a call that raises, overruns or returns the wrong type ends
    the episode with a recorded error)::

        env = EnvClass(**env_kwargs)       one instance per episode
        obs = env.reset(row)               row: the prompt row as a dict: every column of the
                                           dataset record (nested ones as they are), plus
                                           prompt_id, answer, data_source, sample_idx,
                                           prompt_text and episode_seed (an int fixed by the
                                           run's seed, the prompt and the sample); obs (text,
                                           chat messages or None) is appended after the prompt
        until done or a limit (max turns, tokens per turn / per episode):
            the model generates one turn (up to EOS)
            result = env.step(turn_text)   StepResult(observation, reward, done)
            the observation is tokenized once and appended (masked out of the loss)
        final = env.close()                always, after the last step, an error or a limit;
                                           a number returned is a final reward

    The episode's reward is the sum of its steps' rewards and the final reward; each step's
    reward is kept too (``turn_rewards``). A class with ``reset`` and ``step`` of these
    signatures works without subclassing this one (``close`` is then optional)."""

    @abstractmethod
    def reset(self, row: dict) -> str | None:
        """Start the episode for ``row``; return text to append to the prompt, or None."""

    @abstractmethod
    def step(self, turn: str) -> StepResult:
        """React to the model's turn (its text, as generated)."""

    def close(self) -> float | None:  # noqa: B027 (optional hook)
        """Release what the episode held (sandboxes, connections); a number returned is
        added to the episode's reward (a game scored only at its end)."""
        return None


def row_seed(row: dict) -> int:
    """The seed of a seeded game for ``row``: the row's own integer ``seed`` column if it has
    one, else the episode's ``episode_seed``."""
    seed = row.get("seed")
    return int(seed) if isinstance(seed, int) else int(row["episode_seed"])


def check_step(result: object) -> StepResult:
    """``result`` as a ``StepResult`` (a ``(observation, reward, done)`` tuple is accepted);
    ``TypeError`` naming what is wrong otherwise."""
    if isinstance(result, tuple) and len(result) == 3:
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned {type(result).__name__}, expected StepResult")
    check_observation(result.observation, "step")
    if not isinstance(result.reward, numbers.Real) or not math.isfinite(float(result.reward)):
        raise TypeError(f"step reward {result.reward!r} is not a finite number")
    if not isinstance(result.done, bool):
        raise TypeError(f"step done is {type(result.done).__name__}, not bool")
    return result


def check_observation(observation: object, where: str) -> None:
    """``TypeError`` unless ``observation`` is text or a list of chat messages; ``where``
    names the call ("step", "reset")."""
    if isinstance(observation, str):
        return
    if isinstance(observation, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in observation):
        return
    raise TypeError(f"{where} returned {type(observation).__name__} as the observation, "
                    "expected str or a list of chat messages {'role': str, 'content': str}")


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
