"""Importing an adapter's library when it is first used."""

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
