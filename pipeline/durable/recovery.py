"""Durable runs, the driver's side: checkpoint, resume, and recover from a lost trainer.

The training loop uses one ``Durable`` per run:

    iteration, weights = durable.start(sampler, scaling, weights, ledger)  # fresh or resumed
    while iteration < cfg.iterations:
        try:    run iteration + 1; durable.check_trainer()
        except: iteration, weights = durable.recover(err, sampler, scaling)   # or re-raised
        ...records...
        iteration, weights = durable.after_iteration(iteration, weights, sampler, scaling, ledger)

* ``start`` of a fresh run seeds the trainer and commits checkpoint 0, so there is always a
  state to go back to; with ``resume`` it restores the newest whole checkpoint instead.
* ``after_iteration`` commits a checkpoint every ``checkpoint_every`` iterations and after the
  last one, keeping ``keep_checkpoints``.
* ``recover``: any failure of an iteration is checked against the trainer's *token* (a name
  the driver gives each trainer life; a worker restarted by its nanny, or a new batch job, has
  none). If the trainer is the same, the error is re-raised; if it was lost, the run goes back
  to the newest whole checkpoint and redoes the iterations since, at most ``max_recoveries``
  times. Generation workers need nothing: the nanny restarts a killed one, Dask recomputes
  its lost tasks, and a fresh engine fetches the version its task names.

Restoring (resume or recover) puts back the trainer's weights, optimizer and RNG, the data
position, the length predictor and throughput model, republishes the restored version and
drops the records of the abandoned iterations (metrics, decisions, rollouts). Resumed runs end
bitwise equal to uninterrupted ones on CPU with ``policy = "static"``: every generation draw
is keyed by (seed, iteration, prompt, sample) (``ops/engine/seeds.py``), the data order by (seed,
epoch) and the position. Under ``policy = "elastic"`` the shards and the order in which they
reach the update depend on measured timings, so a resumed run is a valid continuation but
not a bitwise copy.
"""

from __future__ import annotations

import gc
import hashlib
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from rlhfless.ops.engine.engine_types import WeightsRef

from ..config import Config, ConfigError, load_config
from ..task_keys import ITERATION_STAGES, TAIL_STAGES, parse_key
from ..tasks.ranks import form_group, on_ranks, store_dir
from ..tasks.trainer import (
    TrainSpec,
    leave_trainer_task,
    publish_task,
    restore_trainer_task,
    save_trainer_task,
    start_trainer_task,
    trainer_token_task,
)
from . import checkpoint as ckpt
from .runs import RunDir

if TYPE_CHECKING:
    from rlhfless.schedulers.ledger import CostLedger
    from rlhfless.schedulers.scaling_policy import ScalingPolicy

    from ..cluster.pools import PoolCluster
    from .sampler import PromptSampler

TRAINER_WAIT_S = 300.0  # how long a trainer may take to come back after a crash
FORGET_WAIT_S = 30.0  # how long the scheduler may take to drop an abandoned iteration
COLLECT_EVERY_S = 5.0  # while waiting for that, at most one garbage collection as often
_VERSION_FILE = re.compile(r"v(\d+)\.safetensors")


class ResumeError(RuntimeError):
    """A run cannot be resumed; the message says why and what to do."""


class TrainerLost(RuntimeError):
    """The trainer process is not the one this run has been training with."""


def resume_config(run_path: str | Path, overrides: list[str] = ()) -> Config:
    """The configuration of the run in ``run_path`` (its ``config.json``), with overrides
    applied; name and runs_dir always point at ``run_path``."""
    path = Path(run_path)
    saved = path / "config.json"
    if not saved.is_file():
        raise ResumeError(f"--resume {run_path}: no config.json there; give the directory of "
                          "a run (runs/<name>)")
    values = RunDir(path).read_json("config.json")
    cfg = load_config(None, overrides, base=values | {"runs_dir": str(path.parent),
                                                      "name": path.name})
    if cfg.run_dir.resolve() != path.resolve():
        raise ConfigError("--resume takes name and runs_dir from the run directory; "
                          "do not override them")
    return cfg


# what a resumed run may change: how long it goes on, how often it evaluates and checkpoints,
# how it recovers, and where its batch jobs run; every other key shapes what it learns
RESUMABLE = ("iterations", "max_wall_s", "eval_every", "checkpoint_every", "keep_checkpoints",
             "on_collapse", "collapse_drop", "collapse_length_growth", "max_rollbacks",
             "max_recoveries", "nonfinite_policy", "job_start_timeout_s", "walltime",
             "worker_lifetime", "queue", "account", "job_prologue",
             "train_workers")  # checkpoints reshard N -> M ranks


def config_changes(cfg: Config) -> dict[str, dict[str, Any]]:
    """``{key: {"old": saved, "new": cfg's}}`` for the keys ``cfg`` changes from the
    ``config.json`` of its run (name and runs_dir are where the run is, not settings);
    ``ResumeError`` naming them if any is not in ``RESUMABLE``."""
    saved = load_config(None, base=RunDir(cfg.run_dir).read_json("config.json")
                        | {"runs_dir": cfg.runs_dir, "name": cfg.name}).to_dict()
    changes = {key: {"old": saved[key], "new": new} for key, new in cfg.to_dict().items()
               if new != saved[key]}
    refused = [f"{k} ({v['old']!r} -> {v['new']!r})" for k, v in changes.items()
               if k not in RESUMABLE]
    if refused:
        raise ResumeError(f"{cfg.run_dir} cannot continue with {', '.join(refused)} changed; "
                          f"a resumed run may change only {', '.join(RESUMABLE)} (start a new "
                          "run for the others)")
    return changes


def open_run(cfg: Config, overwrite: bool = False, resume: bool = False) -> RunDir:
    """A new run directory; with ``resume`` the existing one, its config.json rewritten with
    the configuration the run continues with (changes of ``RESUMABLE`` keys only, each
    appended to config_changes.jsonl first). Either is locked by this process until
    ``RunDir.release`` (runs.py)."""
    if not resume:
        return RunDir.create(cfg, overwrite=overwrite)
    if overwrite:
        raise ResumeError("resume continues a run and overwrite replaces it: choose one")
    if not (cfg.run_dir / "config.json").is_file():
        raise ResumeError(f"cannot resume {cfg.run_dir}: it is not a run directory "
                          "(no config.json)")
    config_changes(cfg)  # refused before anything is written
    run = RunDir.take(cfg.run_dir)  # refused while another process runs it
    try:
        changes = config_changes(cfg)  # the saved config, now that no one else writes it
        path, _ = _newest_whole(cfg.run_dir / "checkpoints", content=False)  # fail early
    except ResumeError:
        run.release()
        raise
    _rewrite_records(run)  # a writer killed mid-line: before anything is appended
    if changes:  # kept, old and new value, before config.json takes the new ones
        run.append_jsonl("config_changes.jsonl", {"time": time.time(), "resumed_from":
                                                  path.name, "changes": changes})
    (run.path / "rollouts").mkdir(exist_ok=True)
    run.write_json("config.json", cfg.to_dict())
    return run


def _newest_whole(root: Path, content: bool = True) -> tuple[Path, list[str]]:
    path, skipped = ckpt.latest(root, content)
    if path is None:
        raise ResumeError(f"no whole checkpoint under {root} "
                          f"({'; '.join(skipped) or 'none written'}); start the run again "
                          "with --overwrite")
    return path, skipped


def data_digest(prompts: pa.Table) -> str:
    """A fingerprint of the prompt order the sampler draws from."""
    ids = "\n".join(map(str, prompts.column("prompt_id").to_pylist()))
    return hashlib.sha256(ids.encode()).hexdigest()[:16]


def _rewrite_records(run: RunDir, keep: Callable[[dict], bool] = lambda r: True) -> None:
    """Keep the records of metrics.jsonl and decisions.jsonl that ``keep`` accepts, and drop
    a last line cut short, so that the next record starts on a fresh line."""
    for name in ("metrics.jsonl", "decisions.jsonl"):
        try:
            run.rewrite_jsonl(name, keep)
        except ValueError as err:
            raise ResumeError(str(err)) from None


def trim_run(run: RunDir, iteration: int, drop_eval_at: bool) -> None:
    """Drop what the run recorded after ``iteration`` (and its eval, if ``drop_eval_at``),
    and a last line that a killed writer left cut short, so records resume on a fresh line."""
    def after(record: dict) -> bool:
        it = record.get("iteration")
        if not isinstance(it, int):
            return False
        return it > iteration or (drop_eval_at and it == iteration
                                  and record.get("event") == "eval")

    _rewrite_records(run, lambda r: not after(r))
    for path in (run.path / "rollouts").glob("iter-*.parquet"):
        if int(path.stem.split("-")[1]) > iteration:
            path.unlink()


def _forget(err: BaseException) -> None:
    """Let go of the tracebacks of ``err`` (and its context): their frames hold the futures
    of the failed iteration, whose keys the redo uses again. Frames of the client's event
    loop sit in reference cycles, hence the collection."""
    seen: set[int] = set()
    node: BaseException | None = err
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        node.__traceback__ = None
        node = node.__context__ or node.__cause__
    gc.collect()


def _held(key: object, first: int) -> bool:
    parsed = parse_key(key)
    return parsed is not None and not parsed.tag and parsed.iteration >= first \
        and parsed.stage in ITERATION_STAGES + TAIL_STAGES


def _iteration_keys(dask_scheduler, first: int) -> list[str]:
    """Keys of iteration ``first`` or later still known to the scheduler (runs there)."""
    return [str(key) for key in dask_scheduler.tasks if _held(key, first)]


class Durable:
    """Checkpoints, resume and recovery of one run; see the module docstring."""

    def __init__(self, pc: PoolCluster, run: RunDir, cfg: Config, spec: TrainSpec,
                 model_path: str | Path, prompts: pa.Table,
                 log: Callable[[str], None] = print) -> None:
        self.pc, self.run, self.cfg, self.spec, self.log = pc, run, cfg, spec, log
        self.model_path = str(model_path)
        self.digest = data_digest(prompts)
        self.root = run.path / "checkpoints"
        self.token = uuid.uuid4().hex
        self.recoveries = 0
        self.totals_before: dict[str, float] = {}  # ledger totals of earlier sessions
        self.restored_tables: dict[str, pa.Table] = {}  # the last restored checkpoint's
        self.collect_tables: Callable[[], dict[str, pa.Table]] = dict  # see ``track``
        self.members: list[str] = []  # addresses of the ranks, when spec.world > 1
        self.anchors: tuple[int, ...] = ()  # iterations a checkpoint at or before is kept for

    def track(self, state_dict: Callable[[], dict[str, pa.Table]]) -> None:
        """Save ``state_dict()``'s tables (a component's own checkpoint state: the mode
        runner's) with every checkpoint from now on; a restore leaves them, for that
        component to load, in ``restored_tables``."""
        self.collect_tables = state_dict

    # ---- the trainer ---------------------------------------------------------------------

    def _on_trainer(self, fn, *args) -> Any:
        """Run ``fn(*args)`` on the trainer; a trainer that is gone is started again."""
        self.pc.sync_events()
        if not self.pc.worker_names("train"):  # a batch job that ended does not come back
            self.pc.grow("train", 1)
        future = self.pc.client.submit(fn, *args, resources={"TRAIN": 1}, pure=False)
        try:
            return future.result(timeout=TRAINER_WAIT_S)
        except TimeoutError as err:
            raise RuntimeError(f"no trainer answered within {TRAINER_WAIT_S:g} s "
                               f"({fn.__name__})") from err

    def _each_rank(self, fn, *args) -> list:
        """``fn(*args)`` on the trainer, or on every rank of its group; results by rank."""
        if self.spec.world == 1:
            return [self._on_trainer(fn, *args)]
        return on_ranks(fn, *args, client=self.pc.client, members=self.members)

    def _form_group(self) -> None:
        """A new process group over the TRAIN pool (ranks.py); any old one is left first."""
        pc = self.pc
        pc.sync_events()
        missing = self.spec.world - len(pc.worker_names("train"))
        if missing > 0:  # batch jobs that ended do not come back
            pc.grow("train", missing)
        names = pc.worker_names("train")[: self.spec.world]
        pc.wait_for(names)
        members = [pc.address_of(n) for n in names]
        self.members = form_group(pc.client, members, members, self.spec.engine.device,
                                  self.spec.parallel, leave_trainer_task,
                                  store_dir(self.run.path))

    def check_trainer(self) -> None:
        """Raise ``TrainerLost`` if the trainer (every rank) is not the one this run trains
        with."""
        if self.spec.world > 1:
            connected = set(self.pc.client.scheduler_info(n_workers=-1)["workers"])
            if gone := [a for a in self.members if a not in connected]:
                raise TrainerLost(f"trainer ranks at {gone} are gone")
        tokens = self._each_rank(trainer_token_task, self.spec)
        if any(token != self.token for token in tokens):
            raise TrainerLost(f"the trainer restarted (tokens {tokens}, expected {self.token})")

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, iteration: int, weights: WeightsRef, sampler: PromptSampler,
             scaling: ScalingPolicy, ledger: CostLedger) -> Path:
        started = time.perf_counter()
        tmp = ckpt.begin(self.root, iteration)
        parts = self._each_rank(save_trainer_task, self.spec, str(tmp), self.token)
        trainer = parts[0] | {"bytes": sum(p["bytes"] for p in parts),
                              "seconds": max(p["seconds"] for p in parts)}
        if trainer["version"] != weights.version:
            raise RuntimeError(f"checkpoint {iteration}: the trainer holds v{trainer['version']}"
                               f", the run is at v{weights.version}")
        now = ledger.totals(until=time.time())
        totals = {k: now.get(k, 0.0) + self.totals_before.get(k, 0.0) for k in now}
        ckpt.write_driver(tmp, ckpt.DriverState(
            iteration=iteration, policy_version=weights.version,
            sampler_position=sampler.position, **scaling.state_dict(),
            ledger_totals=totals, model_path=self.model_path, data_digest=self.digest,
            finite=all(p["finite"] for p in parts), tables=self.collect_tables()))
        path = ckpt.commit(tmp)
        ckpt.prune(self.root, self.cfg.keep_checkpoints, self.anchors)
        self.run.append_metrics({"event": "checkpoint", "iteration": iteration,
                                 "policy_version": weights.version, "path": str(path),
                                 "bytes": trainer["bytes"], "trainer_write_s": trainer["seconds"],
                                 "checkpoint_s": time.perf_counter() - started})
        return path

    def restore(self, path: Path, sampler: PromptSampler, scaling: ScalingPolicy,
                drop_eval_at: bool) -> tuple[int, WeightsRef]:
        """Put the run back to the checkpoint at ``path``; returns (iteration, weights)."""
        driver = ckpt.read_driver(path)
        if driver.data_digest and driver.data_digest != self.digest:
            raise ResumeError(f"checkpoint {path} was taken over other prompts (data digest "
                              f"{driver.data_digest}, now {self.digest}); resuming would not "
                              "continue the same data order")
        if self.spec.world > 1:  # the old group may have lost a rank: a new one
            self._form_group()
        version = self._each_rank(restore_trainer_task, self.spec, str(path), self.token)[0]
        for published in self.run.weights.glob("v*.safetensors"):  # abandoned versions
            m = _VERSION_FILE.fullmatch(published.name)
            if m and int(m.group(1)) > version:
                published.unlink()
        weights = self._on_trainer(publish_task, {}, self.spec, version)
        sampler.position = driver.sampler_position
        scaling.load_state_dict({"predictor": driver.predictor, "throughput": driver.throughput,
                               "update_seconds": driver.update_seconds, "kv": driver.kv})
        self.restored_tables = driver.tables
        trim_run(self.run, driver.iteration, drop_eval_at)
        return driver.iteration, weights

    def start(self, sampler: PromptSampler, scaling: ScalingPolicy, weights: WeightsRef,
              ledger: CostLedger, resume: bool = False) -> tuple[int, WeightsRef]:
        """A fresh run: seed the trainer and commit checkpoint 0. ``resume``: restore the
        newest whole checkpoint. Returns (iteration done, weights)."""
        if not resume:
            if self.spec.world > 1:
                self._form_group()
            self._each_rank(start_trainer_task, self.spec, self.cfg.seed, self.token)
            self.save(0, weights, sampler, scaling, ledger)
            return 0, weights
        path, skipped = _newest_whole(self.root)
        self._say_skipped(skipped, path)
        self.totals_before = dict(ckpt.read_driver(path, restore_rng=False).ledger_totals)
        iteration, weights = self.restore(path, sampler, scaling, drop_eval_at=True)
        self.run.append_metrics({"event": "resume", "iteration": iteration,
                                 "policy_version": weights.version, "path": str(path),
                                 "skipped": skipped})
        return iteration, weights

    def after_iteration(self, iteration: int, weights: WeightsRef, sampler: PromptSampler,
                        scaling: ScalingPolicy, ledger: CostLedger,
                        last: bool = False) -> tuple[int, WeightsRef]:
        """Commit a checkpoint when one is due (always after the ``last`` iteration the run
        makes); if the trainer died meanwhile, recover."""
        if (iteration % self.cfg.checkpoint_every and iteration != self.cfg.iterations
                and not last):
            return iteration, weights
        try:
            self.save(iteration, weights, sampler, scaling, ledger)
        except Exception as err:
            return self.recover(err, sampler, scaling)
        return iteration, weights

    def recover(self, err: Exception, sampler: PromptSampler,
                scaling: ScalingPolicy) -> tuple[int, WeightsRef]:
        """Re-raise ``err`` unless the trainer was lost; if it was, go back to the newest whole
        checkpoint. Returns (iteration restored, weights)."""
        if not isinstance(err, TrainerLost):
            try:
                self.check_trainer()
            except TrainerLost:
                pass
            else:
                raise err
        self.recoveries += 1
        if self.recoveries > self.cfg.max_recoveries:
            raise RuntimeError(f"the trainer was lost {self.recoveries} times, more than "
                               f"max_recoveries = {self.cfg.max_recoveries}") from err
        error = f"{type(err).__name__}: {err}"[:500]
        _forget(err)
        path, skipped = ckpt.latest(self.root)
        if path is None:
            raise RuntimeError(f"the trainer was lost and no whole checkpoint is left under "
                               f"{self.root} ({'; '.join(skipped)})") from err
        self._say_skipped(skipped, path)
        self._wait_forgotten(ckpt.iteration_of(path) + 1)
        iteration, weights = self.restore(path, sampler, scaling, drop_eval_at=False)
        self.run.append_metrics({"event": "recover", "iteration": iteration,
                                 "policy_version": weights.version, "path": str(path),
                                 "error": error, "skipped": skipped,
                                 "recoveries": self.recoveries})
        return iteration, weights

    def rollback(self, at_most: int, sampler: PromptSampler,
                 scaling: ScalingPolicy) -> tuple[int, WeightsRef]:
        """Go back to the newest whole checkpoint of iteration ``at_most`` or earlier (the
        collapse guard's good state) and remove the newer ones, so that neither a recovery
        nor a resume returns to the fallen state. Returns (iteration restored, weights)."""
        path, skipped = ckpt.latest(self.root, at_most=at_most)
        if path is None:
            raise RuntimeError(f"no whole checkpoint of iteration {at_most} or earlier under "
                               f"{self.root} ({'; '.join(skipped) or 'none kept'})")
        self._say_skipped(skipped, path)
        for newer in ckpt.checkpoints(self.root):
            if ckpt.iteration_of(newer) > ckpt.iteration_of(path):
                newer.rename(newer.with_name(f".old-{newer.name}"))  # whole or gone, then
        ckpt.prune(self.root, self.cfg.keep_checkpoints, self.anchors)  # removed
        self._wait_forgotten(ckpt.iteration_of(path) + 1)
        return self.restore(path, sampler, scaling, drop_eval_at=False)

    def _say_skipped(self, skipped: list[str], used: Path) -> None:
        """One line for every newer checkpoint passed over, and why."""
        for line in skipped:
            self.log(f"checkpoint skipped, using {used.name}: {line}")

    def _wait_forgotten(self, first: int) -> None:
        """Wait (bounded) until this client and the scheduler dropped the tasks of the
        abandoned iterations: the redo reuses their keys, and a key still held would hand
        back its old error."""
        client = self.pc.client
        deadline, collected = time.time() + FORGET_WAIT_S, 0.0
        while ((mine := any(_held(k, first) for k in list(client.futures)))
               or client.run_on_scheduler(_iteration_keys, first=first)):
            if time.time() > deadline:
                break
            # a collection frees only this client's futures, and holds this process (the
            # scheduler's event loop too) while it runs: collecting every 0.1 s with a few
            # million objects on the heap held the loop 1.6-2.3 s at a time, heartbeats unread
            if mine and time.time() - collected > COLLECT_EVERY_S:
                gc.collect()
                collected = time.time()
            time.sleep(0.1)
