"""``rlhfless`` command line: ``train`` a policy, render an iteration's ``graph``.

    rlhfless train [config.toml] [--set key=value ...] [--overwrite]
    rlhfless train --resume runs/<name> [--set key=value ...]
    rlhfless export runs/<name> [--iteration N] -o hf-model/
    rlhfless graph [config.toml] [--set key=value ...] [-o iteration.png]
    rlhfless simulate [scenario.toml ...] [--plan --deadline S | --budget GPU_S]
    rlhfless report runs/<name> [-o DIR]

A bad input ends in one line on stderr and exit status 2 (``--debug``: the traceback too);
anything else that goes wrong is one line naming the exception, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dask
from dask.core import get_dependencies
from dask.utils import key_split

from rlhfless.ops.data.records import BadRow
from rlhfless.ops.data.schema import PROMPTS
from rlhfless.ops.engine.publish import WeightsRef

from .config import ConfigError, load_config
from .durable.checkpoint import add_export_parser, export_from_args
from .durable.recovery import ResumeError, resume_config
from .durable.runs import RunDir, RunDirError
from .report.page import add_parser as add_report_parser
from .report.page import run_from_args as report_from_args
from .sim.simulate import add_parser as add_simulate_parser
from .sim.simulate import run_from_args as simulate_from_args
from .task_keys import parse_key, stage_of
from .train.graph import STAGE_COLOURS, iteration_graph
from .train.loop import Diverged, make_specs, train


def render_graph(cfg, filename: str) -> str:
    """Write the graph of one iteration (nothing runs) to ``filename`` through graphviz."""
    run = RunDir(cfg.run_dir)
    specs = make_specs(cfg, cfg.model, run)
    prompts = PROMPTS.empty_table()
    graph = iteration_graph(prompts, WeightsRef(0, cfg.model), 1, cfg.gen_workers, specs.gen,
                            specs.reward, specs.train, algorithm=cfg.algorithm, seed=cfg.seed,
                            min_prefix=cfg.min_prefix)
    outputs = graph.outputs()
    keys = dict(dask.base.collections_to_expr(outputs).__dask_graph__())
    attrs = {
        k: {"style": "filled", "fillcolor": STAGE_COLOURS[stage_of(k)], "label": str(k)}
        if stage_of(k) in STAGE_COLOURS else {"label": "", "shape": "point"}
        for k in keys
    }
    shards = {dep: {"label": f"shard {parse_key(k).shard}"}  # the input of generate-1-i
              for k in keys if stage_of(k) == "generate"
              for dep in get_dependencies(keys, k) if key_split(dep) == "getitem"}
    dask.visualize(*outputs, filename=filename, optimize_graph=False, rankdir="LR",
                   function_attributes=attrs, data_attributes=shards)
    return filename


# errors of what the user gave (config, paths, data, run directories, a learning rate that
# diverges): one line, exit 2
USER_ERRORS = (ConfigError, ResumeError, RunDirError, BadRow, FileNotFoundError,
               IsADirectoryError, NotADirectoryError, PermissionError, Diverged)


def main(argv: list[str] | None = None) -> int:
    """The command line; every error is one line on stderr unless ``--debug`` is given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        return run_command([a for a in argv if a != "--debug"])
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"rlhfless: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:
        if debug:
            raise
        print(f"rlhfless: unexpected {type(err).__name__}: {one_line(err)} (rerun with "
              "--debug for the traceback)", file=sys.stderr)
        return 1


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (a config error says so first)."""
    text = " ".join(str(err).split()) or type(err).__name__
    prefix = {ConfigError: "config error: ", ResumeError: "cannot resume: "}.get(type(err), "")
    return prefix + (text if len(text) <= 400 else text[:397] + "...")


def run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlhfless", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (any position)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("train", "graph"):
        p = sub.add_parser(name)
        p.add_argument("config", nargs="?", help="TOML file (optional)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config key (repeatable)")
        if name == "train":
            p.add_argument("--overwrite", action="store_true",
                           help="replace an existing run directory of the same name")
            p.add_argument("--no-progress", action="store_true")
            p.add_argument("--resume", metavar="RUN", help="continue the run in directory RUN "
                           "from its newest whole checkpoint, with its config.json")
        else:
            p.add_argument("-o", "--output", default="iteration.png")
    add_simulate_parser(sub)
    add_export_parser(sub)
    add_report_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return simulate_from_args(args)
    if args.command == "export":
        return export_from_args(args)
    if args.command == "report":
        return report_from_args(args)
    resume = getattr(args, "resume", None)
    if resume and args.config:
        raise ConfigError("--resume reads the run's config.json; change keys with --set")
    cfg = resume_config(resume, args.set) if resume else load_config(args.config, args.set)
    if args.command == "graph":
        folder = Path(args.output).resolve().parent
        if not folder.is_dir():
            raise ConfigError(f"graph -o {args.output}: the folder {folder} does not exist; "
                              "create it or choose another path")
        print(render_graph(cfg, args.output))
        return 0
    run = train(cfg, overwrite=args.overwrite, progress=not args.no_progress,
                resume=bool(resume))
    evals = [m for m in run.metrics() if m.get("event") == "eval"]
    summary = {"run": str(run.path), "heldout_accuracy_start": evals[0]["heldout_accuracy"],
               "heldout_accuracy_end": evals[-1]["heldout_accuracy"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
