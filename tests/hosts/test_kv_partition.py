"""A tail's KV transfer between generation hosts, its source's link cut as it sends the KV.

One elastic iteration (``tests/pipeline/train/tail_support.py``: 8 prompts, sampling, two
float64 generation workers, checked token for token against one worker decoding the whole
batch uninterrupted) whose generation workers and trainer are hosts of a ``Network``
(``netns_hosts.py``), started as batch jobs start them (``hosts_deploy.py``), under the stall
watch (``supervise``: ``min_stall_s``, ``worker_ttl_s``). The policy moves the first paused
tail to the other host by KV transfer. As the source answers the target's request for the
exported KV (Dask's ``get_data``: the request has arrived, the reply goes out on the link),
its link is cut for ``BLIP_S``, less than the deadlines, and restored; what should happen:

* absorbed: no worker is declared lost, the move lands by transfer with its bytes, and its
  transfer took at least the cut (the reply could not cross before the link came back);
* every (prompt, sample) comes out once, as uninterrupted decoding (``elastic_iteration``).

No namespace, link or process is left (the ``network`` fixture checks).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from distributed.diagnostics.plugin import WorkerPlugin
from host_faults import read_strikes
from hosts_deploy import HostsDeployment

from rlhfless.pipeline.cluster.supervise import drain_stalls, supervise
from rlhfless.pipeline.train.elastic import ElasticGeneration
from rlhfless.schedulers.migration import Migration
from rlhfless.schedulers.scaling_policy import ScalingPolicy

MIN_STALL_S, WORKER_TTL_S, STALL_FACTOR, BLIP_S = 6.0, 8.0, 2.0, 2.0
HOSTS = ("gen-0", "gen-1", "train-0")
TAIL_SUPPORT = Path(__file__).parents[1] / "pipeline" / "train" / "tail_support.py"


def tail_support():
    """``tests/pipeline/train/tail_support.py`` (its directory is not on this one's path)."""
    if "tail_support" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tail_support", TAIL_SUPPORT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["tail_support"] = module
    return sys.modules["tail_support"]


class MovingOncePolicy(ScalingPolicy):
    """The elastic policy, except that the first paused tail moves to another worker by KV
    transfer (as ``test_kv_elastic.py``'s); later tails resume where they are."""

    moved = False

    def migrate(self, progress, kv_transfer=False):
        assert kv_transfer  # the hf backend ships KV caches
        paused = [w for w, p in progress.items() if not p.busy and len(p.seq_ids)]
        moves = [] if self.moved else [Migration(
            source=w, target=next(t for t in progress if t != w),
            seq_ids=tuple(progress[w].seq_ids), recompute_tokens=0, completion_fraction=0.0,
            stay_seconds=1.0, move_seconds=0.5, stay_cost_ws=1.0, move_cost_ws=0.5,
            reason="test: move once", kv="transfer") for w in paused][:1]
        self.moved = self.moved or bool(moves)
        return moves

    def choose_tail(self, progress, tails, threads, supported, kv_transfer, force=""):
        """Moves only: split and reconfiguration are tested in test_tail_actions.py."""
        return super().choose_tail(progress, tails, threads, supported - {"split", "reconfig"},
                                   kv_transfer, force)


class KVSendBlip(WorkerPlugin):
    """As the worker answers the first request for an exported KV (a key ``export-...``),
    cut its own link for ``seconds``, then restore it; appends the strike to ``record``."""

    name = "kv-send-blip"

    def __init__(self, record: Path, cuts: dict[str, tuple[list, list]], seconds: float):
        self.record, self.cuts, self.seconds = record, cuts, seconds

    def setup(self, worker) -> None:
        name = str(worker.name)
        if name not in self.cuts:
            return
        cut, restore = self.cuts[name]
        serve, state = worker.handlers["get_data"], {"armed": True}

        async def get_data(comm, *args, **kwargs):
            keys = [str(k) for k in kwargs.get("keys", args[0] if args else ())]
            if state["armed"] and any(k.startswith("export-") for k in keys):
                state["armed"] = False
                with open(self.record, "a") as out:
                    out.write(json.dumps({"time": time.time(), "worker": name,
                                          "keys": keys}) + "\n")
                subprocess.run(cut, check=True)
                worker.loop.call_later(self.seconds, subprocess.run, restore)
            return await serve(comm, *args, **kwargs)
        worker.handlers["get_data"] = get_data


cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kv_transfer_whose_source_link_blips_lands_by_transfer(
        network, eos_model_dir, tmp_path, monkeypatch):
    placement = {name: network.add_host(name) for name in HOSTS}
    support = tail_support()
    strikes, stalls = tmp_path / "strikes.jsonl", []

    def on_hosts(pools, ledger, **kwargs):
        # the hosts import tail_support's task functions (the float64 engine) from its
        # directory, as a site ships its code to its nodes
        pools = [dataclasses.replace(p, env={**p.env, "PYTHONPATH": str(TAIL_SUPPORT.parent)})
                 for p in pools]
        deployment = HostsDeployment(network, placement, None, tmp_path / "hosts", tmp_path)
        return cluster(pools, ledger, deployment=deployment, **kwargs)

    class Watched(ElasticGeneration):
        """Elastic generation under the stall watch, the blip armed on both sources."""

        def __init__(self, pc, *args, **kwargs):
            super().__init__(pc, *args, **kwargs)
            supervise(pc, STALL_FACTOR, MIN_STALL_S, WORKER_TTL_S)
            pc.client.register_plugin(KVSendBlip(strikes, {
                name: (network.cut_command(placement[name]),
                       network.restore_command(placement[name]))
                for name in pc.worker_names("gen")}, BLIP_S))

        def run_generation(self, *args, **kwargs):
            try:
                return super().run_generation(*args, **kwargs)
            finally:
                stalls.extend(drain_stalls(self.pc))

    cluster = support.PoolCluster
    monkeypatch.setattr(support, "PoolCluster", on_hosts)
    started = time.time()
    run, facts, *_ = support.elastic_iteration(eos_model_dir, tmp_path / "runs",
                                               MovingOncePolicy, Watched)
    (strike,) = read_strikes(strikes)
    (move,) = [d for d in run.read_jsonl("decisions.jsonl") if d["kind"] == "migrate"]
    assert strike["worker"] == move["source"] and any(
        k.startswith("export-") for k in strike["keys"])
    # absorbed: nobody declared lost, the move landed by transfer, its KV's bytes sent
    assert stalls == []
    assert move["path"] == move["landed_by"] == "transfer"
    assert move["bytes"] > 0 and move["landed_sequences"] == move["sequences"]
    assert facts["migrated_sequences"] == move["sequences"]
    # the reply went out on the cut link: it crossed once the link was back
    assert move["actual_s"] >= BLIP_S
    run.release()
    print(f"the iteration on hosts took {time.time() - started:.1f} s; {move['source']} cut "
          f"{BLIP_S:g} s as it sent {move['bytes']} bytes of KV ({move['sequences']} "
          f"sequences) to {move['target']}; the move took {move['actual_s']:.2f} s")
