"""The training loop: GRPO/RLOO on Dask, one iteration after the other.

    for each iteration:
        batch    ← the next prompts, in a seeded epoch order
        graph    ← dedup → shard → generate → reward → advantage, then update → publish
        run it on the pools: sync, every sample by the trainer's version; async, batches
                 generated ahead within a staleness bound; replay, groups reused
        log metrics, the rollouts, and every ``eval_every`` the held-out accuracy
        the collapse guard reads them: a fall is said, or rolled back (guard.py)
        commit a checkpoint every ``checkpoint_every``; lost the trainer? back to the last one

An update whose loss or gradient is not finite is never applied (``ops/algo/update.py``); with
``nonfinite_policy = "stop"`` the run then ends after recording that iteration, with one line
naming it (``Diverged``) and no checkpoint of it: the newest checkpoint is the last finite
state; with ``"skip"`` the batch is dropped (said once per iteration) and the run goes on.

Held-out accuracy is the mean reward of greedy responses to the held-out prompts. Every mode
and both scheduling policies run through one driver, ``modes.ModeRunner``: ``step`` trains
one iteration, generating as far ahead as the mode allows (sync: nothing ahead). What the run
is built from (model, prompts, task specs) is ``specs.py``; the prompt order is
``sampler.py``; what is recorded around an iteration is ``bookkeeping.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import dask
from tqdm.auto import tqdm

from ..cluster.pools import PoolCluster, fit_overlap, pools_from_config
from ..cluster.supervise import dask_bounds, drain_stalls, supervise
from ..config import Config
from ..durable import checkpoint as ckpt
from ..durable.recovery import Durable, open_run
from ..durable.runs import RunDir, umask
from ..report.bookkeeping import account, bill_env_wait, say_reward_errors, write_ledger
from ..report.observe import observed
from ..report.trace import RunTrace, TaskStream
from ..report.trackers import tracked
from .build import build_run
from .elastic import ElasticGeneration
from .evaluation import evaluate
from .generation import GraphGeneration
from .guard import CollapseGuard, collapse_record, respond
from .inputs import check_inputs, given_prompts, write_given_prompts
from .modes import ModeRunner
from .render import render_graph


class Diverged(RuntimeError):
    """An update's loss or gradient was not finite and ``nonfinite_policy = "stop"``."""


def check_finite(record: dict, cfg: Config, run: RunDir, log) -> None:
    """Act on an iteration whose update was not applied for a non-finite loss or gradient:
    ``Diverged`` (policy "stop") or one line saying the batch was skipped."""
    if not record.get("nonfinite_update"):
        return
    iteration = record["iteration"]
    found = f"loss {record.get('loss')}, grad_norm {record.get('grad_norm')}"
    if cfg.nonfinite_policy == "skip":
        log(f"iteration {iteration}: non-finite update ({found}); batch skipped, weights "
            "unchanged (nonfinite_policy = 'skip')")
        return
    newest, _ = ckpt.latest(run.path / "checkpoints", content=False)
    raise Diverged(f"iteration {iteration}: the loss or gradient is not finite ({found}); its "
                   "update was not applied and the run stops (nonfinite_policy = 'stop'); "
                   f"the newest checkpoint, {newest.name if newest else 'none'}, is the last "
                   "finite state: export it, or start again with a lower lr or "
                   "nonfinite_policy = 'skip'")


def train(cfg: Config, overwrite: bool = False, progress: bool = True, log=print,
          on_metrics: Callable[[dict], None] | None = None, resume: bool = False,
          dataset: Any = None, heldout: Any = None) -> RunDir:
    """Run ``cfg.iterations`` iterations in ``cfg.mode``; returns the run directory.
    ``on_metrics`` gets every record appended to metrics.jsonl, as it is appended.
    ``resume``: continue the run in ``cfg.run_dir`` from its newest whole checkpoint.
    ``dataset`` / ``heldout``: prompts as a ``pyarrow.Table``, ``datasets.Dataset`` or pandas
    ``DataFrame`` instead of the keys of ``cfg``; the run keeps a copy (``given_prompts``).
    The run directory is locked by this call while it runs (runs.py); a run it replaces is
    put back if this one fails before it records its first iteration."""
    with umask(cfg.run_umask):  # what the run and its local workers write (runs.py)
        cfg, given = given_prompts(cfg, dataset=dataset, heldout=heldout)
        # bad paths and rewards fail before the run directory exists
        check_inputs(cfg, given=frozenset(given))
        run = open_run(cfg, overwrite=overwrite, resume=resume)
        try:
            write_given_prompts(cfg, given)
            with tracked(cfg, run, partial(render_graph, cfg), log):  # report_to
                _train_in(run, cfg, progress, log, on_metrics, resume)
        except BaseException:
            run.restore_replaced()  # nothing once the first iteration dropped the old run
            raise
        finally:
            run.release()
    return run


def _train_in(run: RunDir, cfg: Config, progress: bool, log,
              on_metrics: Callable[[dict], None] | None, resume: bool) -> None:
    cfg = split_pools(run, cfg, log)
    if cfg.update_lr != cfg.lr:
        factors = [f"{key} {getattr(cfg, key):g}" for key, applies in
                   (("off_policy_lr_factor", cfg.mode != "sync"), ("agent_lr_factor", cfg.agent))
                   if applies and getattr(cfg, key) != 1]
        log(f"{cfg.mode}: updates at learning rate {cfg.update_lr:.3g} (lr {cfg.lr:.3g} x "
            f"{' x '.join(factors)}); {' and '.join(f.split()[0] for f in factors)} = 1 keeps lr")
    parts = build_run(cfg, run, log)
    specs, sampler, ledger, scaling = parts.specs, parts.sampler, parts.ledger, parts.scaling
    heldout, weights = parts.heldout, parts.weights
    pools = pools_from_config(cfg, elastic=cfg.policy == "elastic")
    with (dask.config.set(dask_bounds(cfg.worker_ttl_s, cfg.connect_timeout_s)),
          PoolCluster(pools, ledger, deployment=parts.deployment) as pc,
          observed(run, pc.dashboard_link, on_metrics)):
        if pc.dashboard_link:
            log(f"dashboard: {pc.dashboard_link} (plain HTTP: any user of this host may read it)")
        supervise(pc, cfg.stall_timeout_factor, cfg.min_stall_s, cfg.worker_ttl_s)
        stream, trace = TaskStream(pc.client), RunTrace(run.path / "trace.json", resume=resume)
        generation = (ElasticGeneration(pc, cfg, run, scaling, parts.rest_workers)
                      if cfg.policy == "elastic" else GraphGeneration(pc, cfg, run, scaling))
        durable = Durable(pc, run, cfg, specs.train, parts.model_path, parts.prompts, log=log)
        done, weights = durable.start(sampler, scaling, weights, ledger, resume=resume)
        accuracy = evaluate(pc, heldout, weights, specs, cfg, scaling)
        run.append_metrics({"event": "eval", "iteration": done, **accuracy})
        bar = tqdm(total=cfg.iterations, initial=done, disable=not progress, desc="train")
        runner, started = ModeRunner(cfg, pc, generation, specs, sampler, durable), time.time()
        durable.track(runner.state_dict)
        guard = CollapseGuard.from_records(cfg, run.metrics())
        if guard.rollbacks:  # a resumed run goes on at the rate its last rollback set
            runner.set_lr(cfg.update_lr * cfg.rollback_lr_factor ** guard.rollbacks)
        said_reward_errors = False
        while done < cfg.iterations:
            say_stalls(run, pc, log)
            iteration, t0 = done + 1, time.time()
            try:
                with trace.phase("step", iteration):
                    record, table, weights = runner.step(iteration, weights)
                durable.check_trainer()
            except Exception as err:  # re-raised unless the trainer was lost
                done, weights = durable.recover(err, sampler, scaling)
                continue
            tasks = stream.take()
            with trace.phase("account", iteration):
                record = {"event": "iteration", **record,
                          **account(pc, ledger, iteration, t0, tasks,
                                    record.get("env_wait_seconds") or 0.0)}
            record |= bill_env_wait(record, ledger.prices)
            run.write_rollouts(iteration, table)
            run.append_metrics(record)
            run.drop_replaced()  # the new run has started: the one it replaced goes
            check_finite(record, cfg, run, log)
            said_reward_errors = said_reward_errors or say_reward_errors(log, iteration, table,
                                                                         cfg.reward_fallback)
            fall = guard.see(record)
            if iteration % cfg.eval_every == 0 or iteration == cfg.iterations:
                with trace.phase("evaluate", iteration):
                    accuracy = evaluate(pc, heldout, weights, specs, cfg, scaling)
                evaluated = {"event": "eval", "iteration": iteration, **accuracy}
                run.append_metrics(evaluated)
                fall = guard.see(evaluated) or fall
            if fall is not None and respond(fall, cfg, guard, run, log):
                trace.write(tasks + stream.take(), {iteration: record}, iteration, t0, record)
                runner.close()  # the batches generated ahead of the fallen policy
                done, weights = durable.rollback(fall.back_to, sampler, scaling)
                guard.went_back(fall, done)
                lr = cfg.update_lr * cfg.rollback_lr_factor ** guard.rollbacks
                runner.set_lr(lr)
                run.append_metrics(collapse_record(fall, "rollback", iteration=done, lr=lr,
                                                   detected_at=fall.iteration))
                log(f"rolled back to iteration {done}; lr now {lr:.3g} "
                    f"(rollback {guard.rollbacks} of at most {cfg.max_rollbacks})")
                continue
            durable.anchors = guard.anchors()
            out_of_time = bool(cfg.max_wall_s) and time.time() - started >= cfg.max_wall_s
            with trace.phase("after_iteration", iteration):  # checkpoint when one is due
                done, weights = durable.after_iteration(iteration, weights, sampler, scaling,
                                                        ledger, last=out_of_time)
            trace.write(tasks + stream.take(), {iteration: record}, iteration, t0, record)
            bar.update(done - bar.n)
            bar.set_postfix(reward=f"{record['reward_mean']:.2f}",
                            heldout=f"{accuracy['heldout_accuracy']:.2f}", **idle_shares(record))
            if out_of_time:  # checkpointed: --resume continues
                log(f"stopped after iteration {done} of {cfg.iterations}: max_wall_s = "
                    f"{cfg.max_wall_s:g} s of training reached")
                break
        runner.close()  # batches generated ahead of a stop
        generation.log_queue_targets(done)
        say_stalls(run, pc, log)
        trace.write(stream.take(), {})
        trace.close()
    write_ledger(run, ledger, durable.totals_before)


def idle_shares(record: dict) -> dict:
    """The progress line's bound and idle share per pool (``pool_time.py``)."""
    shares = {f"{pool}_idle": f"{record[f'{pool}_idle_share']:.0%}" for pool in ("gen", "train")
              if record.get(f"{pool}_idle_share") is not None}
    return {"bound": record.get("bound"), **shares}


def split_pools(run: RunDir, cfg: Config, log) -> Config:
    """The pools an async run on this machine's cores gets (``fit_overlap``), recorded and
    said when they differ from the configured ones."""
    fitted, split = fit_overlap(cfg)
    if split is None or (fitted.gen_workers, fitted.train_threads) == (cfg.gen_workers,
                                                                      cfg.train_threads):
        return fitted
    run.append_metrics({"event": "pool_split", **split.to_record(),
                        "asked_gen_workers": cfg.gen_workers,
                        "asked_train_threads": cfg.train_threads})
    log(f"{cfg.mode}: {split.gen_workers} generation worker(s) and {split.train_threads} "
        f"trainer thread(s) fit the {split.cores} cores (asked {cfg.gen_workers} and "
        f"{cfg.train_threads}); overlap_pools = \"as_set\" keeps what was asked")
    return fitted


def say_stalls(run: RunDir, pc: PoolCluster, log) -> None:
    """Record and say the workers dropped (and restarted where their host answers) because
    a task of theirs stalled."""
    for record in drain_stalls(pc):
        run.append_metrics({"event": "stall", **record})
        log(f"worker {record['worker']} made no progress on {record['key']} for "
            f"{record['no_progress_s']:.1f} s (deadline {record['deadline_s']:.1f} s): "
            "dropped, and restarted where its host answers; its tasks run again")
