"""Record a short real run for the simulator's calibration test (tests/data/recorded_run/).

Runs the synchronous pipeline (``rlhfless.pipeline.train.loop.train``) on the tiny default model
and task for a few iterations on a LocalCluster, then copies its ``config.json`` and
``metrics.jsonl`` and a slim copy of every ``rollouts/iter-N.parquet`` (the columns the
simulator replays: ids, lengths, workers, timings, rewards; heavy ones like ``logprobs`` and
``response_text`` are dropped) into the output directory. Exact command, from the repo root:

    python bench/record_run.py --out tests/data/recorded_run

Held-out evaluation runs only before the first and after the last iteration
(``eval_every`` larger than ``iterations``), so the iterations are back to back and the
run's worker-seconds are ``workers * (last iteration end - first iteration start)``.
The default 24 iterations of 32 prompts x 8 samples (2 generation workers, 1 trainer) keep
the data near 300 KB while giving the calibration ten held-out iterations after four
warm-up ones: on a shared machine a single iteration's timings swing by 2x, so the test
compares means over many. Record on a quiet machine (the committed run started after the
1-minute load average had stayed below 2.5 for 30 s). Prints one JSON line: iterations, run
seconds, output size in bytes, load average at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train

KEEP_COLUMNS = (
    "prompt_id", "prompt_ids", "sample_idx", "response_ids", "finish_reason", "worker",
    "gen_start", "gen_end", "policy_version", "reward", "advantage",
)


def slim_copy(run: Path, out: Path, runs_dir: str) -> int:
    """Copy the run's config, metrics and slimmed rollouts to ``out``; returns bytes written.

    The temporary ``runs_dir`` the run was written under is replaced by ``runs`` in the
    copied text, so the committed files name no path of the recording machine."""
    if out.exists():
        shutil.rmtree(out)
    (out / "rollouts").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl"):
        (out / name).write_text((run / name).read_text().replace(runs_dir, "runs"))
    for path in sorted((run / "rollouts").glob("iter-*.parquet")):
        table = pq.read_table(path)
        keep = [c for c in KEEP_COLUMNS if c in table.column_names]
        pq.write_table(table.select(keep), out / "rollouts" / path.name, compression="zstd")
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data/recorded_run", help="output directory")
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--gen-workers", type=int, default=2)
    parser.add_argument("--batch-prompts", type=int, default=32)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(name="recorded", runs_dir=tmp, iterations=args.iterations,
                     eval_every=args.iterations + 1, heldout_prompts=32,
                     gen_workers=args.gen_workers, batch_prompts=args.batch_prompts)
        run = train(cfg, progress=False)
        size = slim_copy(run.path, Path(args.out), tmp)
    lines = [json.loads(x) for x in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    its = [m for m in lines if m.get("event") == "iteration"]
    run_s = its[-1]["time"] - (its[0]["time"] - its[0]["iteration_s"])
    print(json.dumps({"iterations": len(its), "run_s": round(run_s, 3), "bytes": size,
                      "out": args.out, "loadavg_1m_at_end": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
