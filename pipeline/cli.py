"""``rlhfless`` command line: ``train`` a policy, render an iteration's ``graph``.

    rlhfless train [config.toml] [--set key=value ...] [--overwrite]
    rlhfless graph [config.toml] [--set key=value ...] [-o iteration.png]
"""

from __future__ import annotations

import argparse
import json
import sys

import dask
from dask.utils import key_split

from rlhfless.ops.publish import WeightsRef
from rlhfless.ops.schema import PROMPTS

from .config import ConfigError, load_config
from .graph import iteration_graph
from .loop import make_specs, train
from .runs import RunDir

STAGE_COLOURS = {
    "dedup": "#8dd3c7", "shard": "#ffffb3", "generate": "#fb8072", "reward": "#80b1d3",
    "advantage": "#fdb462", "update": "#b3de69", "publish": "#bc80bd",
}


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
    dask.visualize(*outputs, filename=filename, optimize_graph=False, rankdir="LR",
                   function_attributes=attrs)
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
        else:
            p.add_argument("-o", "--output", default="iteration.png")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        print(f"rlhfless: config error: {err}", file=sys.stderr)
        return 2
    if args.command == "graph":
        print(render_graph(cfg, args.output))
        return 0
    run = train(cfg, overwrite=args.overwrite, progress=not args.no_progress)
    evals = [m for m in run.metrics() if m.get("event") == "eval"]
    summary = {"run": str(run.path), "heldout_accuracy_start": evals[0]["heldout_accuracy"],
               "heldout_accuracy_end": evals[-1]["heldout_accuracy"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
