"""Importing an adapter's library when it is first used, and a class by its path."""

from __future__ import annotations

import importlib


def import_library(module: str, package: str):
    """``importlib.import_module(module)``, or a one-line ``ValueError`` naming the package
    to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise ValueError(f"{package} is not installed: pip install {package}") from None


def import_class(name: str, target: str) -> type:
    """The class ``target`` (``"package.module:Class"``) names; ``name`` is what was
    configured, for the messages (``ValueError``, or what importing the module raised)."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"{name!r}: name the class as 'package.module:Class'")
    cls = getattr(importlib.import_module(module), attr, None)
    if cls is None:
        raise ValueError(f"environment {name!r}: module {module!r} has no {attr!r}")
    if not isinstance(cls, type):
        raise ValueError(f"environment {name!r} is a {type(cls).__name__}, not a class")
    return cls
