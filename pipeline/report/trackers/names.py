"""The tracker names ``report_to`` may list, and its check: read by the config, so this
module imports nothing of the pipeline."""

from __future__ import annotations

import importlib.util

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
AUTO = "auto"  # TensorBoard when it is installed, as runs did before report_to existed


def check_report_to(report_to: list[str]) -> None:
    """``ValueError`` with one line if ``report_to`` names an unknown or uninstalled tracker."""
    for name in report_to:
        if name != AUTO and name not in TRACKERS:
            raise ValueError(f"report_to = {report_to}: {name!r} is not a tracker; choose any "
                             f"of {(AUTO, *TRACKERS)} (auto: tensorboard when installed)")
        if name != AUTO and importlib.util.find_spec(name) is None:
            raise ValueError(f"report_to = {report_to}: {name!r} is named but its package is "
                             f"not installed; pip install 'rlhfless[{name}]', or remove it")


def tracker_names(report_to: list[str]) -> list[str]:
    """The trackers ``report_to`` stands for, in its order, ``auto`` resolved."""
    names: list[str] = []
    for name in report_to:
        if name == AUTO:
            name = "tensorboard" if importlib.util.find_spec("tensorboard") else None
        if name is not None and name not in names:
            names.append(name)
    return names
