"""The engine protocol and the values it passes import nothing heavy: an engine with no
model (the emulated one), the driver and the scheduler use them without torch."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "vllm")


def test_the_protocol_loads_no_framework():
    code = ("import sys\n"
            "import rlhfless.ops.engine.protocol, rlhfless.ops.engine.engine_types, "
            "rlhfless.ops.engine.rows\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert loaded == "[]", f"importing the engine protocol loaded {loaded}"


def test_the_check_sees_a_framework_when_one_is_loaded():
    code = ("import sys\nimport rlhfless.ops.engine.generate\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert "torch" in loaded
