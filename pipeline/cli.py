"""``rlhfless`` command line: ``train`` a policy, render an iteration's ``graph``.

    rlhfless train [config.toml] [--set key=value ...] [--overwrite]
    rlhfless train --resume runs/<name> [--set key=value ...]
    rlhfless export runs/<name> [--iteration N] -o hf-model/
    rlhfless graph [config.toml] [--set key=value ...] [-o iteration.png]
    rlhfless simulate [scenario.toml ...] [--plan --deadline S | --budget GPU_S]
    rlhfless report runs/<name> [-o DIR] [--iterations A:B]
    rlhfless trace runs/<name> [--iterations A:B] [-o FILE]
    rlhfless config [--example NAME]

A bad input ends in one line on stderr and exit status 2 (``--debug``: the traceback too);
anything else that goes wrong is one line naming the exception, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Only what parsing needs is imported here: each subcommand imports its implementation in its
# handler, so ``rlhfless --help`` and ``rlhfless report`` load neither torch nor the simulator.

# errors of what the user gave (config, paths, data, run directories): one line, exit 2. The
# project's own are named by module: an exception of such a class exists only once its module
# is loaded, so none is imported here for the sake of an ``except``.
USER_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
USER_ERROR_CLASSES = {  # module -> class: prefix of its one-line message
    "rlhfless.pipeline.config": {"ConfigError": "config error: "},
    "rlhfless.pipeline.durable.recovery": {"ResumeError": "cannot resume: "},
    "rlhfless.pipeline.durable.runs": {"RunDirError": ""},
    "rlhfless.ops.data.records": {"BadRow": ""},
    "rlhfless.pipeline.train.loop": {"Diverged": ""},  # a learning rate that diverges
    "rlhfless.pipeline.train.guard": {"Collapsed": ""},  # a run whose quality fell
    "rlhfless.ops.algo.update": {"EpisodesFailed": ""},  # an environment that always fails
}


def user_error_prefix(err: BaseException) -> str | None:
    """The prefix of a user error's one line ("" for none); None if ``err`` is not one."""
    for module, classes in USER_ERROR_CLASSES.items():
        for name, prefix in classes.items():
            cls = getattr(sys.modules.get(module), name, None)
            if cls is not None and isinstance(err, cls):
                return prefix if type(err) is cls else ""
    return "" if isinstance(err, USER_ERRORS) else None


def main(argv: list[str] | None = None) -> int:
    """The command line; every error is one line on stderr unless ``--debug`` is given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        return run_command([a for a in argv if a != "--debug"])
    except Exception as err:
        if debug:
            raise
        prefix = user_error_prefix(err)
        if prefix is not None:
            print(f"rlhfless: {prefix}{one_line(err)}", file=sys.stderr)
            return 2
        print(f"rlhfless: unexpected {type(err).__name__}: {one_line(err)} (rerun with "
              "--debug for the traceback)", file=sys.stderr)
        return 1


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line, at most 400 characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def config_of(args: argparse.Namespace):
    """The run configuration ``train`` and ``graph`` were given (``--resume``: the run's)."""
    from .config import ConfigError, load_config

    resume = getattr(args, "resume", None)
    if resume and args.config:
        raise ConfigError("--resume reads the run's config.json; change keys with --set")
    if resume:
        from .durable.recovery import resume_config

        return resume_config(resume, args.set)
    return load_config(args.config, args.set)


def train_command(args: argparse.Namespace) -> int:
    cfg = config_of(args)  # a bad key is said before torch and the training loop load
    from .train.loop import train

    run = train(cfg, overwrite=args.overwrite, progress=not args.no_progress,
                resume=bool(args.resume))
    evals = [m for m in run.metrics() if m.get("event") == "eval"]
    summary = {"run": str(run.path), "heldout_accuracy_start": evals[0]["heldout_accuracy"],
               "heldout_accuracy_end": evals[-1]["heldout_accuracy"]}
    print(json.dumps(summary))
    return 0


def graph_command(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .train.render import render_graph

    cfg = config_of(args)
    folder = Path(args.output).resolve().parent
    if not folder.is_dir():
        raise ConfigError(f"graph -o {args.output}: the folder {folder} does not exist; "
                          "create it or choose another path")
    print(render_graph(cfg, args.output))
    return 0


def simulate_command(args: argparse.Namespace) -> int:
    from .sim.simulate import run_from_args

    return run_from_args(args)


def export_command(args: argparse.Namespace) -> int:
    from .durable.export import export_from_args

    return export_from_args(args)


def report_command(args: argparse.Namespace) -> int:
    from .report.page import run_from_args

    return run_from_args(args)


def trace_command(args: argparse.Namespace) -> int:
    from .report.trace import write_part

    first, last = args.iterations
    print(write_part(Path(args.run), first, last, args.output))
    return 0


def iteration_range(text: str) -> tuple[int, float]:
    """``A:B``, ``A:`` or ``:B`` (iterations, both ends included) as (first, last)."""
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (int(first) if first else 0, int(last) if last else float("inf"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--iterations {text!r}: give A:B, A: or :B with whole numbers, e.g. 3:5") from None
    return bounds


def config_command(args: argparse.Namespace) -> int:
    from .explain import example, listing

    print(example(args.example) if args.example else listing(), end="")
    return 0


def run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlhfless", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (any position)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, handler in (("train", train_command), ("graph", graph_command)):
        p = sub.add_parser(name)
        p.set_defaults(handler=handler)
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
    p = sub.add_parser("simulate", help="simulate runs on a cluster; compare policies or plan")
    p.set_defaults(handler=simulate_command)
    p.add_argument("scenario", nargs="*", help="scenario TOML file(s); none: the paper's two")
    p.add_argument("--out", default="runs/simulate", help="report directory")
    p.add_argument("--iterations", type=int, help="override every scenario's iterations")
    p.add_argument("--quick", action="store_true", help="skip the tau/lambda/alpha sweeps")
    p.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib)")
    p.add_argument("--plan", action="store_true", help="recommend pool size and lambda")
    p.add_argument("--deadline", type=float, help="plan: mean seconds per iteration")
    p.add_argument("--budget", type=float, help="plan: GPU-seconds per iteration")
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    p.set_defaults(handler=export_command)
    p.add_argument("run", help="the run directory (runs/<name>)")
    p.add_argument("--iteration", type=int, help="which checkpoint (default: the newest whole "
                   "one with finite weights; refused if the newest is damaged)")
    p.add_argument("-o", "--output", required=True,
                   help="directory to write (new or empty, outside any run directory)")
    p.add_argument("--model", help="model directory for config and tokenizer "
                   "(default: the one the run started from)")
    p = sub.add_parser("report", help="write an HTML report of a run")
    p.set_defaults(handler=report_command)
    p.add_argument("run", help="the run directory, runs/<name>")
    p.add_argument("-o", "--output", help="directory for index.html and its images "
                   "(default: RUN/report)")
    p.add_argument("--iterations", type=iteration_range, metavar="A:B",
                   help="draw the tasks of iterations A to B (default: the last)")
    p = sub.add_parser("trace", help="write (a part of) a run's trace for Perfetto")
    p.set_defaults(handler=trace_command)
    p.add_argument("run", help="the run directory, runs/<name>")
    p.add_argument("--iterations", type=iteration_range, default=(0, float("inf")),
                   metavar="A:B", help="only iterations A to B, both included (default: all)")
    p.add_argument("-o", "--output", help="file to write (default: RUN/trace-A-B.json)")
    p = sub.add_parser("config", help="list every config key with its default and meaning, "
                       "or print an example config")
    p.set_defaults(handler=config_command)
    p.add_argument("--example", metavar="NAME", help="print the example config NAME (a TOML "
                   "file to start from; an unknown NAME lists them)")
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
