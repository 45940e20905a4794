"""``rlhfless`` command line: ``train`` a policy, render an iteration's ``graph``.

    rlhfless train [config.toml] [--set key=value ...] [--overwrite]
    rlhfless train --resume runs/<name> [--set key=value ...]
    rlhfless export runs/<name> [--iteration N] -o hf-model/
    rlhfless graph [config.toml] [--set key=value ...] [-o iteration.png]
    rlhfless simulate [scenario.toml ...] [--plan --deadline S | --budget GPU_S]
    rlhfless report runs/<name> [-o DIR]
"""

from __future__ import annotations

import argparse
import json
import sys

import dask
from dask.core import get_dependencies
from dask.utils import key_split

from rlhfless.ops.publish import WeightsRef
from rlhfless.ops.schema import PROMPTS

from .checkpoint import add_export_parser, export_from_args
from .config import ConfigError, load_config
from .graph import STAGE_COLOURS, iteration_graph
from .loop import make_specs, train
from .recovery import ResumeError, resume_config
from .report import add_parser as add_report_parser
from .report import run_from_args as report_from_args
from .runs import RunDir
from .simulate import add_parser as add_simulate_parser
from .simulate import run_from_args as simulate_from_args


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
        k: {"style": "filled", "fillcolor": STAGE_COLOURS[key_split(k)], "label": str(k)}
        if key_split(k) in STAGE_COLOURS else {"label": "", "shape": "point"}
        for k in keys
    }
    shards = {dep: {"label": f"shard {str(k).rsplit('-', 1)[1]}"}  # the input of generate-1-i
              for k in keys if key_split(k) == "generate"
              for dep in get_dependencies(keys, k) if key_split(dep) == "getitem"}
    dask.visualize(*outputs, filename=filename, optimize_graph=False, rankdir="LR",
                   function_attributes=attrs, data_attributes=shards)
    return filename


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhfless", description=__doc__.splitlines()[0])
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
    try:
        if resume and args.config:
            raise ConfigError("--resume reads the run's config.json; change keys with --set")
        cfg = resume_config(resume, args.set) if resume else load_config(args.config, args.set)
    except ConfigError as err:
        print(f"rlhfless: config error: {err}", file=sys.stderr)
        return 2
    except ResumeError as err:
        print(f"rlhfless: cannot resume: {err}", file=sys.stderr)
        return 2
    if args.command == "graph":
        print(render_graph(cfg, args.output))
        return 0
    try:
        run = train(cfg, overwrite=args.overwrite, progress=not args.no_progress,
                    resume=bool(resume))
    except ResumeError as err:
        print(f"rlhfless: cannot resume: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # found once the data is read
        print(f"rlhfless: config error: {err}", file=sys.stderr)
        return 2
    evals = [m for m in run.metrics() if m.get("event") == "eval"]
    summary = {"run": str(run.path), "heldout_accuracy_start": evals[0]["heldout_accuracy"],
               "heldout_accuracy_end": evals[-1]["heldout_accuracy"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
