"""Tool calls in the OpenAI function style, and the sandboxed Python tool (ops/rollouts/tools.py).

The sandbox tests run real child processes. Writes outside the sandbox are refused only
where bubblewrap or Landlock works; the test says so (skip) rather than pass without it.
What hostile code cannot do is in test_hostile_tool.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket

import pytest

from rlhfless.ops.rollouts import sandbox
from rlhfless.ops.rollouts.env import PythonToolEnv, StepResult, check_step
from rlhfless.ops.rollouts.resolve import resolve_environment
from rlhfless.ops.rollouts.sandbox import SandboxLimits, run_python
from rlhfless.ops.rollouts.tools import Tool, ToolCall, call_tool, parse_tool_calls
from rlhfless.ops.toy.tinytool import TallyToolEnv, box_items, tool_call


def test_tool_calls_parse_and_errors_go_back_to_the_model():
    text = ('thinking <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            "<tool_call>not json</tool_call><tool_call>[1]</tool_call>")
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert calls[1].startswith("error: tool call is not JSON") and calls[2].startswith("error")
    add = Tool("add", "Add two numbers.", {"type": "object", "required": ["a", "b"],
               "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
               lambda a, b: a + b)
    assert add.schema()["function"]["name"] == "add" and add.schema()["type"] == "function"
    tools = {"add": add}
    assert call_tool(tools, calls[0]) == "3"
    assert call_tool(tools, ToolCall("mul", {})).startswith("error: no tool 'mul'")
    assert "missing ['b']" in call_tool(tools, ToolCall("add", {"a": 1}))
    assert call_tool(tools, ToolCall("add", {"a": 1, "b": "x"})).startswith("error: TypeError")


def test_tally_tool_environment_looks_up_and_scores():
    env = TallyToolEnv()
    env.reset({"answer": str(len(box_items(417)))})
    step = env.step(tool_call(417))
    assert not step.done and " ".join(box_items(417)) in step.observation
    assert step.observation.endswith("Answer:")
    assert env.step(f" 1 x = {len(box_items(417))}") == StepResult("", 1.0, True)
    assert env.step(" 1 x = 99").reward == 0.0
    assert resolve_environment("tally-tool") is TallyToolEnv
    with pytest.raises(ValueError, match="not one of"):
        resolve_environment("nope")
    with pytest.raises(TypeError, match="not bool"):
        check_step(("obs", 0.0, "yes"))


def test_python_tool_runs_code_and_gets_its_limits(tmp_path):
    out = run_python("import sys\nprint(sum(range(10)))\nopen('f.txt', 'w').write('ok')",
                     tmp_path / "box")
    assert out.stdout == "45\n" and out.returncode == 0
    assert (tmp_path / "box" / "f.txt").read_text() == "ok"
    slow = run_python("import time\ntime.sleep(30)", tmp_path / "box", SandboxLimits(wall_s=1))
    assert slow.timed_out and "timeout" in slow.text()
    spin = run_python("while True: pass", tmp_path / "box", SandboxLimits(wall_s=20, cpu_s=1))
    assert not spin.timed_out and spin.returncode < 0  # SIGXCPU / SIGKILL at the CPU limit
    big = run_python("x = bytearray(2 * 2**30)", tmp_path / "box",
                     SandboxLimits(memory_bytes=256 * 2**20))
    assert "MemoryError" in big.stderr


def test_python_tool_cannot_reach_a_listening_port(tmp_path):
    """A real listener outside the sandbox: a tool sharing the host's network connects."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "print('connected')")
        net = run_python(code, tmp_path / "box")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection is waiting
    assert net.returncode != 0 and "connected" not in net.stdout, net


def test_python_tool_cannot_write_outside_its_sandbox(tmp_path):
    outside = tmp_path / "outside.txt"
    out = run_python(f"open({str(outside)!r}, 'w').write('escaped')", tmp_path / "box")
    if out.enforced.get("writes") not in ("landlock", "tmpfs"):
        pytest.skip("neither namespaces nor Landlock here: writes outside are not prevented")
    refused = ("PermissionError", "FileNotFoundError")  # Landlock; not in the sandbox's view
    assert not outside.exists() and any(e in out.stderr for e in refused), out
    mkdir = run_python(f"import os\nos.mkdir({str(tmp_path / 'd')!r})", tmp_path / "box")
    assert mkdir.returncode != 0 and not (tmp_path / "d").exists()


def test_python_environment_episode(tmp_path):
    env = PythonToolEnv(wall_s=5, sandbox_root=str(tmp_path))
    env.reset({"answer": "12"})
    call = {"name": "python", "arguments": {"code": "print(3 * 4)"}}
    step = env.step(f"<tool_call>{json.dumps(call)}</tool_call>")
    assert step.observation == "<tool_response>12</tool_response>\n" and not step.done
    assert env.step("The answer is \\boxed{12}") == StepResult("", 1.0, True)
    env.close()
    assert list(tmp_path.iterdir()) == []  # the sandbox went with the episode


def test_the_fallback_layer_runs_and_says_so(tmp_path, monkeypatch):
    """Where bubblewrap cannot run: the Landlock/rlimit layer, named in ``enforced``, and a
    child holding the output pipe does not hold the call past its wall limit: what the child
    prints after its 30 s of sleep (begun after the call) is not in the result."""
    monkeypatch.setattr(sandbox, "_PROBE", [False])
    out = run_python("print(sum(range(10)))", tmp_path / "box")
    assert out.stdout == "45\n" and out.returncode == 0 and out.enforced["sandbox"] == "landlock"
    held = ("import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(30); print(\"outlived\", flush=True)'], "
            "start_new_session=True)\nopen('child.pid', 'w').write(str(child.pid))")
    out = run_python(held, tmp_path / "box", SandboxLimits(wall_s=2))
    child = int((tmp_path / "box" / "child.pid").read_text())
    try:
        assert out.returncode == 0  # the code itself ended; only the child held the call
        assert "outlived" not in out.stdout, "the call waited for the child to exit"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
