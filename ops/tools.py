"""Tools in the OpenAI function-call style, and the sandboxed Python tool.

A ``Tool`` is a Python callable with an OpenAI function schema (``Tool.schema()``::

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}

the list chat templates take as ``tools=``). The model calls tools the way Hermes / Qwen chat
templates teach it, one JSON object per call::

    <tool_call>{"name": "lookup", "arguments": {"box": "417"}}</tool_call>

``parse_tool_calls`` finds the calls of a turn; ``call_tool`` runs one and turns every failure
of the model's call (unknown tool, bad arguments, the tool raising) into an error *result*
for the model to read, not an error of the episode.

``run_python`` is the built-in code tool. The code runs in a fresh child process:

* time: killed (with its whole process group) after ``wall_s``; ``RLIMIT_CPU`` = ``cpu_s``;
* memory: ``RLIMIT_AS`` = ``memory_bytes``; files: ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
  no core dumps;
* writes: only inside its sandbox directory (its working directory). Enforced by the kernel
  with Landlock (Linux >= 5.13) when available: the child restricts itself before the code
  runs, and that cannot be undone; reading stays allowed. Without Landlock, writes outside
  are *not* prevented and ``SandboxResult.enforced`` says so;
* network: the child runs in an empty network namespace (``unshare --net --map-root-user``)
  when user namespaces are allowed; Landlock ABI >= 4 also refuses TCP bind and connect.
  With neither, a Python preamble refuses to create sockets, which code that reaches the OS
  by other means (ctypes, a subprocess) can get around; ``enforced`` says which held.

The child runs ``python -I`` (no user site, no ``PYTHON*`` variables) with a minimal
environment whose ``HOME`` and ``TMPDIR`` are the sandbox.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
RESULT_CHARS = 2000  # a tool result is cut to this many characters


@dataclass(frozen=True)
class Tool:
    """A function the model may call; ``parameters`` is a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., object]

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """The calls in a model turn, in order; a call that is not ``{"name": str, "arguments":
    {...}}`` JSON comes back as an error string in its place."""
    calls: list[ToolCall | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(f"error: tool call is not JSON ({err.msg})")
            continue
        if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str)
                or not isinstance(obj.get("arguments", {}), dict)):
            calls.append('error: a tool call is {"name": str, "arguments": object}')
            continue
        calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    return calls


def call_tool(tools: dict[str, Tool], call: ToolCall | str) -> str:
    """The text result of one call; the model's mistakes become ``error: ...`` results."""
    if isinstance(call, str):
        return call
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool {call.name!r}; tools: {', '.join(sorted(tools))}"
    required = tool.parameters.get("required", [])
    missing = [k for k in required if k not in call.arguments]
    unknown = [k for k in call.arguments if k not in tool.parameters.get("properties", {})]
    if missing or unknown:
        return f"error: {call.name} arguments: missing {missing}, unknown {unknown}"
    try:
        result = tool.fn(**call.arguments)
    except Exception as err:  # the tool failed on the model's input: the model reads why
        return f"error: {type(err).__name__}: {err}"[:RESULT_CHARS]
    return str(result)[:RESULT_CHARS]


# ---------------------------------------------------------------- the Python sandbox


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: int = 2
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 2**20  # largest file the code may write
    open_files: int = 64
    output_chars: int = RESULT_CHARS


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the wall-clock limit
    timed_out: bool
    enforced: dict = field(default_factory=dict)  # {"writes": ..., "network": ...}

    def text(self) -> str:
        """What the model reads: stdout, then stderr, then how it ended if not cleanly."""
        parts = [self.stdout.rstrip(), self.stderr.rstrip()]
        if self.timed_out:
            parts.append("error: timeout")
        elif self.returncode:
            parts.append(f"exit status {self.returncode}")
        return "\n".join(p for p in parts if p)


# Runs first in the child: reads the code, restricts writes with Landlock (and TCP when the
# ABI has it), or falls back to refusing sockets in Python; then runs the code.
_BOOTSTRAP = r"""
import ctypes, json, os, sys
code = open("main.py").read()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
status = {"writes": "none", "network": os.environ.pop("RLHFLESS_NETNS", "none")}
abi = libc.syscall(444, None, 0, 1)
if abi >= 1:
    write = 1 << 1 | sum(1 << b for b in range(4, 13))
    write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    net = 3 if abi >= 4 else 0
    attr = (ctypes.c_uint64 * 2)(write, net)
    fd = libc.syscall(444, ctypes.byref(attr), 16 if net else 8, 0)
    home = os.open(".", os.O_PATH)
    rule = ctypes.create_string_buffer(write.to_bytes(8, "little")
                                       + home.to_bytes(4, "little", signed=True), 12)
    ok = fd >= 0 and libc.syscall(445, fd, 1, rule, 0) == 0
    ok = ok and libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, fd, 0) == 0
    if ok:
        status["writes"] = "landlock"
        if net:
            status["network"] = "+".join(s for s in (status["network"], "landlock-tcp")
                                         if s != "none")
if status["network"] == "none":
    import socket
    def _refuse(*a, **k):
        raise PermissionError("network access is disabled in this sandbox")
    socket.socket = socket.create_connection = socket.socketpair = _refuse
    status["network"] = "python-preamble"
sys.stderr.write("\x00SANDBOX " + json.dumps(status) + "\n")
sys.stderr.flush()
del ctypes, libc
exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
"""
_STATUS = re.compile(r"\x00SANDBOX (\{.*?\})\n")


def _netns_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    probe = subprocess.run([unshare, "--net", "--map-root-user", "true"],
                           capture_output=True, timeout=10)
    return [unshare, "--net", "--map-root-user"] if probe.returncode == 0 else []


_NETNS: list[list[str]] = []  # probed once per process


def _limit(limits: SandboxLimits) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(code: str, sandbox: str | os.PathLike[str],
               limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in a child process confined to the directory ``sandbox`` (created if
    needed); see the module docstring for what is enforced."""
    home = Path(sandbox).resolve()
    home.mkdir(parents=True, exist_ok=True)
    (home / "main.py").write_text(code)
    if not _NETNS:
        _NETNS.append(_netns_prefix())
    prefix = _NETNS[0]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8",
           "RLHFLESS_NETNS": "namespace" if prefix else "none"}
    proc = subprocess.Popen([*prefix, sys.executable, "-I", "-c", _BOOTSTRAP], cwd=home,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_limit(limits),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limits.wall_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        timed_out = True
    stderr = err.decode(errors="replace")
    found = _STATUS.search(stderr)
    enforced = json.loads(found.group(1)) if found else {}  # the first line: ours, before the code
    stderr = stderr[found.end():] if found else stderr
    cut = limits.output_chars
    return SandboxResult(out.decode(errors="replace")[:cut], stderr[:cut],
                         None if timed_out else proc.returncode, timed_out, enforced)
