"""The import rules of the layout, read from the source with ``ast`` (every import, module-level
or inside a function): ``ops`` imports neither ``pipeline`` nor ``schedulers``; ``schedulers``
never imports ``pipeline`` and, outside ``schedulers/dask``, neither Dask nor torch; no private
name (``_x``) is imported from another module; and the command line's entry points load no
torch (checked in a fresh interpreter)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from test_import_cycles import modules

ROOT = Path(__file__).resolve().parents[1]


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names taken from it) for every import statement of ``name``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            out.append((module, [a.name for a in node.names]))
    return out


def offences(source: dict[str, Path], rule) -> list[str]:
    return sorted(f"{name} imports {module}" for name, path in source.items()
                  for module, _ in imports(name, path) if rule(name, module))


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_rules_see_what_they_forbid(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch\n    from ..pipeline import loop\n")
    found = imports("rlhfless.schedulers.bad", bad)
    assert ("torch", []) in found and ("rlhfless.pipeline", ["loop"]) in found


def test_ops_imports_neither_pipeline_nor_schedulers():
    ops = {n: p for n, p in modules().items() if under(n, "rlhfless.ops")}
    assert len(ops) > 20
    assert offences(ops, lambda _, m: under(m, "rlhfless.pipeline", "rlhfless.schedulers")) == []


def test_schedulers_are_pure_outside_their_dask_package():
    scheds = {n: p for n, p in modules().items() if under(n, "rlhfless.schedulers")}
    assert "rlhfless.schedulers.dask.plugin" in scheds
    assert offences(scheds, lambda _, m: under(m, "rlhfless.pipeline")) == []
    pure = {n: p for n, p in scheds.items() if not under(n, "rlhfless.schedulers.dask")}
    assert offences(pure, lambda _, m: under(m, "dask", "distributed", "torch")) == []


def test_no_private_name_crosses_modules():
    crossing = sorted(f"{name}: from {module} import {n}"
                      for name, path in modules().items()
                      for module, names in imports(name, path)
                      for n in names if n.startswith("_") and not n.startswith("__"))
    assert crossing == []


def test_the_pipeline_reaches_engines_through_their_protocol_only():
    """No pipeline module imports an engine class or touches an engine's model: every task
    drives its engine through ``ops/engine/protocol.py``."""
    pipeline = {n: p for n, p in modules().items() if under(n, "rlhfless.pipeline")}
    assert offences(pipeline, lambda _, m: m == "rlhfless.ops.engine.vllm_backend") == []
    named = sorted(f"{n}: {module} import {x}" for n, path in pipeline.items()
                   for module, names in imports(n, path) for x in names
                   if x in ("HFBackend", "VLLMBackend"))
    assert named == []
    touching = sorted(n for n, path in pipeline.items()
                      if re.search(r"engine\.model\b", path.read_text()))
    assert touching == []


def torch_loaders(steps: dict[str, str]) -> list[str]:
    """Run ``steps`` (name -> code) in order in one fresh interpreter; the names of those
    after which torch was imported (a step that fails fails the caller)."""
    code = ["import sys", "loaded = []"]
    for name, step in steps.items():
        code += [step, f"if 'torch' in sys.modules: loaded.append({name!r})"]
    code.append("print(','.join(loaded))")
    out = subprocess.run([sys.executable, "-c", "\n".join(code)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return [name for name in out.stdout.splitlines()[-1].split(",") if name]


def test_the_command_line_loads_no_torch_for_help_config_and_report(tmp_path):
    """``--help``, ``config`` (listing and examples), config loading, ``train`` with a bad
    key, and ``report``, one after the other in one interpreter: none imports torch."""
    run = ROOT / "tests" / "data" / "recorded_run"  # a real run directory, read only
    steps = {
        "import": "from rlhfless.pipeline.cli import main",
        "--help": "try:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "config": "assert main(['config']) == 0",
        "config --example": "assert main(['config', '--example', 'gsm8k']) == 0",
        "load_config": "from rlhfless.pipeline.config import load_config\n"
                       "load_config(None, ['iterations=2'])",
        "train with a bad key": "assert main(['train', '--set', 'run_dir=x']) == 2",
        "report": f"assert main(['report', {str(run)!r}, '-o', {str(tmp_path)!r}]) == 0",
    }
    assert torch_loaders(steps) == []
    assert (tmp_path / "index.html").is_file()
    # the probe can see torch
    assert torch_loaders({"loop": "import rlhfless.pipeline.train.loop"}) == ["loop"]


def test_the_tree_passes_its_linter():
    """``ruff check`` with the rules of pyproject.toml (line length, import order, pyflakes):
    a finding fails here, not in a reader's editor."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


# The pipeline's parts, lowest first: each imports only parts before it. A module that
# depends on nothing of the pipeline outside its own part (it imports none, or only such
# modules of its part: a table of names, checkpoint I/O over ``ops``) may be imported from
# anywhere: it closes no cycle.
PIPELINE_ORDER = ("task_keys", "config", "tasks", "cluster", "durable", "specs", "sim",
                  "report", "train", "notebook", "explain", "cli")


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["rlhfless", "pipeline"] and len(parts) > 2 else None


def test_the_pipelines_parts_import_only_the_parts_before_them():
    source = modules()
    known = set(source)
    pipeline_imports = {name: {t for m, taken in imports(name, path) if _part(m)
                               for t in ([f"{m}.{n}" for n in taken if f"{m}.{n}" in known]
                                         or [m])}
                        for name, path in source.items()}
    leaves: set[str] = set()
    while True:  # modules importing only leaves of their own part, to a fixed point
        more = {n for n, deps in pipeline_imports.items()
                if deps <= leaves and {_part(d) for d in deps} <= {_part(n)}} - leaves
        if not more:
            break
        leaves |= more
    upward: dict[tuple[str, str], list[str]] = {}
    for name, path in source.items():
        part = _part(name)
        if part not in PIPELINE_ORDER:
            continue
        for module, taken in imports(name, path):
            targets = [t for t in (f"{module}.{n}" for n in taken) if t in known] or [module]
            for target in targets:
                other = _part(target)
                if other in PIPELINE_ORDER and other != part and target not in leaves \
                        and PIPELINE_ORDER.index(other) > PIPELINE_ORDER.index(part):
                    upward.setdefault((part, other), []).append(f"{name} imports {target}")
    assert not upward, f"imports against PIPELINE_ORDER: {upward}"
