"""A run whose workers are hosts of their own, with the faults a network makes.

The driver (and its scheduler) is this machine's namespace; the trainer, a spare host for a
second one, and three generation workers are hosts of a ``Network`` (``netns_hosts.py``),
started as batch jobs start them on other nodes (``hosts_deploy.py``), over TLS with the
run's credentials; versions travel worker to worker (``weight_store = "cluster"``), and the
generation hosts do not see the run directory (a mount namespace of their own where it
holds only the run's credentials, ``tls/``): none of its files is needed there. The
run's Dask bounds come from its config: the scheduler's worker TTL (``worker_ttl_s``) and
every process's comm timeouts (``connect_timeout_s``), the remote workers' through their
environment. One static run of five iterations (a checkpoint after each) takes five
faults, each struck mid-decode of a generation task, as the trainer's update starts or as
the trainer answers a weight fetch (``host_faults.py``), and what should happen is written
first:

* iteration 2, gen-1's link cut for ``BLIP_S`` (less than the deadline ``min_stall_s``) and
  restored: absorbed. No worker is declared lost, nothing is restarted or run again, and
  gen-1 is billed as one lifetime to the end of the run.
* iteration 2 also, the trainer's link cut for ``BLIP_S`` as its update starts: absorbed,
  the run goes on without going back to a checkpoint.
* iteration 3, gen-0's link cut for good: gen-0 is declared lost once its silence passes
  ``worker_ttl_s``, which is shorter here than its decoding task's deadline
  (``stall_timeout_factor`` x the task's predicted duration + ``min_stall_s``), not at
  Dask's default TTL of 5 minutes; its rows are generated again on the other hosts; the
  ledger bills gen-0 only until it was declared lost.
* iteration 4, gen-2's host killed (every process at once): its connections close, it is
  declared lost at once and its rows are generated again on gen-1.
* iteration 5, the trainer's link cut for good as it answers gen-1's fetch of version 4
  (the request arrived, the reply goes out on the cut link): train-0 is declared lost at
  ``min_stall_s`` (it holds no decoding task), and the fetch fails then, not at its
  connection's timeout (``connect_timeout_s``, or Dask's 30 s): the scheduler has every
  worker close its connections to a worker it removed. The generation task fails with it,
  and the iteration's other generation tasks, abandoned, fail at once (the holder has left
  the cluster: ``local_weights`` does not ask it) rather than hold gen-1 for a connection
  timeout each;
  a new trainer is started on the spare host at once (batch deployments start no worker
  by themselves), and the run goes back to checkpoint 4, publishes version 4 again from
  the new trainer and redoes iteration 5; train-0 is billed until it was declared lost.

Every iteration 1-5 is recorded once, and in each every (prompt, sample) is used exactly
once. No namespace, link or process is left (the ``network`` fixture checks).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import dask
import pyarrow.parquet as pq
import pytest
from distributed.client import _get_global_client
from host_faults import HostFault, TaskErrors, read_strikes
from hosts_deploy import deploy_on_hosts
from run_support import train_in_thread, wait_for

from rlhfless.pipeline.config import Config

ITERATIONS, PROMPTS, SAMPLES = 5, 4, 4
MIN_STALL_S, WORKER_TTL_S, CONNECT_S, BLIP_S = 6.0, 8.0, 11.0, 2.0
STALL_FACTOR = 100.0  # a decoding task's deadline, tens of seconds: the TTL comes first
SLACK_S = 3.0  # the stall watch's check period, heartbeats and this machine's lag
HOSTS = ("train-0", "gen-0", "gen-1", "gen-2")  # at the start; train-1 is the spare


def run_client(thread: threading.Thread, out: dict):
    """The run's client, once every host's worker has connected."""
    def ready():
        if not thread.is_alive():
            raise AssertionError(f"the run ended before its workers connected: {out}")
        client = _get_global_client()
        if client is None or client.status != "running":
            return None
        names = {str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        return client if set(HOSTS) <= names else None
    return wait_for(ready, 180, "every host's worker")


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def lifetimes(run: Path, name: str) -> list[dict]:
    ledger = json.loads((run / "ledger.json").read_text())["records"]
    return [r for r in ledger if r["kind"] == "worker" and r["name"] == name]


@pytest.mark.slow
def test_a_run_across_hosts_absorbs_a_blip_and_loses_a_cut_and_a_killed_host(
        network, tiny_model_dir, tmp_path, monkeypatch):
    placement = {name: network.add_host(name) for name in (*HOSTS, "train-1")}
    deploy_on_hosts(monkeypatch, network, placement, tmp_path / "hosts", frozenset({"gen"}))
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path / "runs"), name="hosts",
                 iterations=ITERATIONS, batch_prompts=PROMPTS, n_samples=SAMPLES,
                 max_new_tokens=16, heldout_prompts=4, eval_every=100, gen_workers=3,
                 train_threads=1, checkpoint_every=1, min_stall_s=MIN_STALL_S,
                 stall_timeout_factor=STALL_FACTOR, worker_ttl_s=WORKER_TTL_S,
                 connect_timeout_s=CONNECT_S, weight_store="cluster",
                 scheduler_host=network.driver_address)
    strikes, errors = tmp_path / "strikes.jsonl", tmp_path / "errors.jsonl"
    started = time.time()
    thread, out = train_in_thread(cfg)
    client = run_client(thread, out)
    hosts_up = time.time()
    assert client.scheduler.address.startswith(f"tls://{network.driver_address}:")
    assert client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.worker_ttl) == WORKER_TTL_S
    timeouts = client.run(lambda: {k: dask.config.get(f"distributed.comm.timeouts.{k}")
                                   for k in ("connect", "tcp")})
    assert sorted(timeouts) == sorted(client.scheduler_info(n_workers=-1)["workers"])
    assert all(t == {"connect": "11s", "tcp": "11s"} for t in timeouts.values()), timeouts
    listings = client.run(lambda run: sorted(os.listdir(run)), str(cfg.run_dir))
    names = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
    assert all((listing == ["tls"]) == names[a].startswith("gen") for a, listing in
               listings.items()), listings  # the trainer sees the run's files, gen-N none
    client.register_plugin(TaskErrors(errors))
    for worker, prefix, action in (("gen-1", "generate-2-", "blip"),
                                   ("train-0", "update-2", "blip"),
                                   ("gen-0", "generate-3-", "cut"),
                                   ("gen-2", "generate-4-", "kill"),
                                   ("train-0", "fetch-4", "cut")):
        host = placement[worker]
        client.register_plugin(HostFault(worker, prefix, action, strikes,
                                         network.cut_command(host),
                                         network.restore_command(host), BLIP_S,
                                         mid_decode=not worker.startswith("train")))
    thread.join(timeout=240)
    assert not thread.is_alive(), "the run did not finish"
    if "error" in out:
        raise out["error"]
    run, ended = out["run"].path, time.time()
    blip, train_blip, cut, kill, train_cut = read_strikes(strikes)
    assert [(s["worker"], s["action"]) for s in (blip, train_blip, cut, kill, train_cut)] == [
        ("gen-1", "blip"), ("train-0", "blip"), ("gen-0", "cut"), ("gen-2", "kill"),
        ("train-0", "cut")]
    assert blip["decoding"] and cut["decoding"] and kill["decoding"]  # struck mid-decode
    metrics = records(run)
    iterations = {m["iteration"]: m for m in metrics if m["event"] == "iteration"}
    assert [m["iteration"] for m in metrics if m["event"] == "iteration"] == list(
        range(1, ITERATIONS + 1))  # none lost, none repeated
    makers = {}
    for it in range(1, ITERATIONS + 1):
        rows = pq.read_table(run / f"rollouts/iter-{it:05d}.parquet",
                             columns=["prompt_id", "sample_idx", "worker"])
        pairs = Counter(zip(rows.column("prompt_id").to_pylist(),
                            rows.column("sample_idx").to_pylist()))
        assert len(pairs) == PROMPTS * SAMPLES and set(pairs.values()) == {1}, (it, pairs)
        makers[it] = set(rows.column("worker").to_pylist())
    # the blip: absorbed. gen-1 delivered its own rows, was never declared lost, and is
    # billed as one lifetime to the end of the run
    assert "gen-1" in makers[2]
    stall, train_stall = [m for m in metrics if m["event"] == "stall"]  # none for gen-1
    (gen1,) = lifetimes(run, "gen-1")
    assert gen1["t_end"] > iterations[ITERATIONS]["time"]
    # the trainer's blip during its update: absorbed too, no recovery from a checkpoint
    (recover,) = [m for m in metrics if m["event"] == "recover"]  # the trainer's cut's
    assert recover["iteration"] == ITERATIONS - 1
    # the cut: gen-0 declared lost at the configured TTL (its task's deadline was longer),
    # its rows generated again by the others, billed until it was declared lost
    assert (stall["worker"], stall["key"], stall["no_heartbeat"]) == ("gen-0", cut["key"], True)
    assert stall["deadline_s"] == WORKER_TTL_S
    assert STALL_FACTOR * stall["predicted_s"] + MIN_STALL_S > WORKER_TTL_S + SLACK_S
    # its silence counts from its last heartbeat before the cut (they come every 0.5 s)
    assert stall["no_progress_s"] > WORKER_TTL_S
    assert WORKER_TTL_S - 1 <= stall["time"] - cut["time"] < WORKER_TTL_S + SLACK_S
    assert "gen-0" not in makers[3] and makers[3] <= {"gen-1", "gen-2"}
    assert iterations[3]["time"] - cut["time"] < stall["deadline_s"] + 2 * SLACK_S
    (gen0,) = lifetimes(run, "gen-0")
    assert abs(gen0["t_end"] - stall["time"]) < SLACK_S
    # the killed host: declared lost at once, its rows generated again on gen-1
    (gen2,) = lifetimes(run, "gen-2")
    assert 0 <= gen2["t_end"] - kill["time"] < SLACK_S
    assert makers[4] == {"gen-1"}
    # the trainer's host cut for good as it answered a fetch: train-0 declared lost at
    # min_stall_s (it decodes nothing), the fetch failed then, before its connection's
    # timeout; a new trainer started on the spare host at once, the run back to checkpoint 4
    assert train_cut["key"] == "fetch-4"
    fetch_failed = read_strikes(errors)[0]
    assert fetch_failed["worker"] == "gen-1" and fetch_failed["key"].startswith("generate-5-")
    assert abs(fetch_failed["time"] - train_stall["time"]) < SLACK_S
    assert fetch_failed["time"] - train_cut["time"] < CONNECT_S
    # the iteration's other generation tasks, abandoned, do not ask the lost trainer: they
    # fail at once, and the redo does not wait for them
    assert all(e["time"] - fetch_failed["time"] < SLACK_S for e in read_strikes(errors))
    assert (train_stall["worker"], train_stall["no_heartbeat"]) == ("train-0", True)
    assert train_stall["deadline_s"] == MIN_STALL_S
    assert train_stall["time"] - train_cut["time"] < MIN_STALL_S + SLACK_S
    (train0,) = lifetimes(run, "train-0")
    assert abs(train0["t_end"] - train_stall["time"]) < SLACK_S
    (train1,) = lifetimes(run, "train-1")  # billed from its request, its start included
    assert train1["t_start"] - train_stall["time"] < SLACK_S < train1["t_ready"] - train1["t_start"]
    assert train1["t_end"] > iterations[ITERATIONS]["time"]
    print(f"hosts up in {hosts_up - started:.1f} s, the run ended {ended - hosts_up:.1f} s "
          f"later; gen-0 declared lost {stall['time'] - cut['time']:.1f} s after its cut "
          f"(deadline {stall['deadline_s']:.1f} s, silent {stall['no_progress_s']:.1f} s), "
          f"iteration 3 ended "
          f"{iterations[3]['time'] - cut['time']:.1f} s after it; gen-2 lost "
          f"{gen2['t_end'] - kill['time']:.2f} s after its kill; gen-1's fetch failed "
          f"{fetch_failed['time'] - train_cut['time']:.1f} s after train-0's cut, train-0 "
          f"lost {train_stall['time'] - train_cut['time']:.1f} s after it, iteration 5 "
          f"ended {iterations[5]['time'] - train_cut['time']:.1f} s after it; "
          f"recovered from {recover['error']!r}; task errors "
          f"{[(e['key'], round(e['time'] - train_cut['time'], 1)) for e in read_strikes(errors)]}"
          f", iteration 5 ended {iterations[5]['time'] - train1['t_ready']:.1f} s after "
          "train-1 was ready")
