"""Export: a run's checkpoint written as a Hugging Face ``save_pretrained`` directory.

``export_hf`` writes any checkpoint (adapters folded into the base weights, the tokenizer
files of the model the run started from). ``rlhfless export`` (``export_from_args``) takes the
newest whole, finite checkpoint and says which and why it passed over newer finite-less
ones; it refuses when the newest checkpoint is damaged (one line naming the problem and the
newest whole one) unless ``--iteration`` names one, refuses an output directory that is not
empty or lies inside a run, and a checkpoint pruned by the live run while it was read is said
so (export again, or name a kept one).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlhfless.ops.engine.lora import merge_adapters

from .checkpoint import (
    checkpoints,
    find,
    is_finite,
    iteration_of,
    open_checkpoint,
    problem,
)
from .zarr_state import get_tensors, load_model_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")


def export_hf(checkpoint: str | Path, out_dir: str | Path,
              model_dir: str | Path | None = None) -> Path:
    """Write the policy of ``checkpoint`` as a Hugging Face model directory
    (``save_pretrained`` layout, in the dtype the weights were trained in) with the tokenizer
    files of ``model_dir`` (default: the model the run started from). A checkpoint whose
    files changed after its commit is refused (``ValueError``), before anything is written."""
    root = open_checkpoint(checkpoint, content=True)
    model_dir = Path(model_dir or root.attrs["model_path"])
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"export_hf: {model_dir} has no config.json; pass the "
                                "model directory the run started from as model_dir")
    tensors = get_tensors(root["trainer/model"])
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    scale = root["trainer"].attrs.get("lora_scale")
    if scale is not None:  # adapters only: folded into the base weights
        tensors = merge_adapters(model.state_dict(), tensors, float(scale))
    load_model_tensors(model, tensors, f"checkpoint {checkpoint}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    return out


class ExportRefused(ValueError):
    """``export`` will not write this (the message says why and what to do)."""


def check_output(out: str | Path, run: str | Path) -> None:
    """``ExportRefused`` unless ``out`` is a new or empty directory outside every run
    directory (``run`` itself included: the model's config.json would replace the run's)."""
    from .runs import is_run  # runs.py reads no checkpoint; imported here to stay light

    target, run_path = Path(out).resolve(), Path(run).resolve()
    runs = [d for d in (target, *target.parents) if is_run(d) or d == run_path]
    if runs:
        raise ExportRefused(f"-o {out} lies inside the run directory {runs[0]}; write the "
                            "model to a directory outside any run")
    if target.exists() and not target.is_dir():
        raise ExportRefused(f"-o {out} is a file; give a new or empty directory")
    if target.is_dir() and any(target.iterdir()):
        raise ExportRefused(f"-o {out} is not empty; give a new or empty directory")


def choose_export(run_path: str | Path, iteration: int | None) -> tuple[Path, list[str]]:
    """The checkpoint ``export`` writes and one line per newer one it passed over: that of
    ``iteration`` if given, else the newest whole one with finite weights. ``ExportRefused``
    when the newest checkpoint is damaged (no manifest, a file cut short) and no
    ``iteration`` names one: exporting an older one unasked would hide the damage."""
    if iteration is not None:
        return find(run_path, iteration, content=False), []
    root = Path(run_path) / "checkpoints"
    found = checkpoints(root)
    if not found:
        raise FileNotFoundError(f"no checkpoint under {root}")
    why = problem(found[-1], content=False)
    if why is not None:
        whole = [iteration_of(p) for p in found if problem(p, content=False) is None]
        hint = (f"export the newest whole one with --iteration {whole[-1]}" if whole
                else "no whole checkpoint is left")
        raise ExportRefused(f"the newest checkpoint {found[-1]} is damaged ({why}); {hint}")
    passed = []
    for path in reversed(found):
        why = problem(path, content=False)
        if why is None and is_finite(path):
            return path, passed
        passed.append(f"{path.name}: {why or 'its weights are not finite (NaN or inf)'}")
    raise FileNotFoundError(f"no whole checkpoint with finite weights under {root} "
                            f"({'; '.join(passed)})")


def export_from_args(args) -> int:
    path = None
    try:
        check_output(args.output, args.run)
        path, passed = choose_export(args.run, args.iteration)
        out = export_hf(path, args.output, args.model)  # it checks the content
    except Exception as err:
        if path is not None and problem(path, content=False) is not None:
            message = (f"checkpoint {path} was pruned by the live run while it was read; "
                       "export again (for the newest), or name one the run keeps with "
                       "--iteration N")
        elif isinstance(err, ExportRefused | FileNotFoundError):
            message = str(err)
        elif isinstance(err, ValueError):
            message = f"{err}; export another one with --iteration N"
        else:
            raise
        print(f"rlhfless: cannot export: {message}", file=sys.stderr)
        return 2
    why = "as asked" if args.iteration is not None else (
        "the newest checkpoint" if not passed else
        f"the newest whole one with finite weights; passed over {'; '.join(passed)}")
    print(f"rlhfless: exported {path.name} ({why})", file=sys.stderr)
    print(json.dumps({"checkpoint": str(path), "hf_model": str(out), "passed_over": passed}))
    return 0
