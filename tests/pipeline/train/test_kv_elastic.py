"""KV moves inside the training loop's elastic generation, on a real LocalCluster.

``ElasticGeneration.run_generation`` (one iteration's generation, scoring and advantages)
on two float64 generation workers, sampling: the policy moves a paused tail to the other
worker with its KV cache (the test's policy moves every paused tail, and priors make the
transfer the cheaper path, so the move is certain; the planner's own choices are tested in
tests/schedulers; the scaling and the transfer-or-recompute choice are the real ones here),
the rollouts equal uninterrupted decoding of the whole batch on one worker token for token
(every draw is keyed by the run seed, the iteration, the prompt and the sample:
``ops/engine/seeds.py``), every (prompt, sample) comes out once, and ``decisions.jsonl`` records
each move's path, predicted and actual seconds and bytes, which the policy has learned from.
A source killed after its export and before the target's adoption loses nothing (slow): the
move lands again, recomputed from the cut rows, and the rollouts are the same.
A short training run on the long-tail task (``task = "tally-long"``) returns every (prompt,
sample) once and logs whatever moves its policy plans the same way (slow; at this size and
load the real policy often plans none: one worker at lambda 0.5, and no move that pays at
lambda 1)."""

from __future__ import annotations

from collections import Counter

import pyarrow.parquet as pq
import pytest
from distributed import wait
from tail_support import elastic_iteration
from worker_support import kill_worker

from rlhfless.ops.engine.kv_transfer import kv_bytes_per_token
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train import build
from rlhfless.pipeline.train.elastic import ElasticGeneration
from rlhfless.pipeline.train.elastic_round import ElasticRound
from rlhfless.pipeline.train.loop import train
from rlhfless.schedulers.migration import Migration
from rlhfless.schedulers.scaling_policy import ScalingPolicy


class MovingPolicy(ScalingPolicy):
    """The elastic policy, except that every paused tail moves to another worker (the
    planner's own choices are tested in tests/schedulers; here the runtime's moves are)."""

    def migrate(self, progress, kv_transfer=False):
        assert kv_transfer  # the hf backend ships KV caches
        return every_paused_tail_moves(progress)

    def choose_tail(self, progress, tails, threads, supported, kv_transfer, force=""):
        """Moves only: split and reconfiguration are tested in test_tail_actions.py."""
        return super().choose_tail(progress, tails, threads, supported - {"split", "reconfig"},
                                   kv_transfer, force)


def every_paused_tail_moves(progress) -> list[Migration]:
    """A move, by KV transfer, of every paused tail in ``progress`` to another worker."""
    paused = [w for w, p in progress.items() if not p.busy and len(p.seq_ids)]
    return [Migration(source=w, target=next(t for t in progress if t != w),
                      seq_ids=tuple(progress[w].seq_ids), recompute_tokens=0,
                      completion_fraction=0.0, stay_seconds=1.0, move_seconds=0.5,
                      stay_cost_ws=1.0, move_cost_ws=0.5, reason="test: always move",
                      kv="transfer") for w in paused]


@pytest.mark.slow
def test_elastic_iteration_moves_kv_and_continues_as_uninterrupted(eos_model_dir, tmp_path):
    run, facts, scaling, cfg = elastic_iteration(eos_model_dir, tmp_path, MovingPolicy)
    moves = [d for d in run.read_jsonl("decisions.jsonl") if d["kind"] == "migrate"]
    assert moves and facts["migrated_sequences"] == sum(m["sequences"] for m in moves)
    for move in moves:
        assert move["path"] == move["landed_by"] == "transfer"
        assert move["bytes"] > 0 and move["actual_s"] > 0
        assert move["landed_sequences"] == move["sequences"]
        assert move["predicted_s"] == move["predicted_transfer_s"] < move["predicted_recompute_s"]
    # learned from the moves: the bytes per token of float64 caches (and the logits that
    # travel with them; the prior assumed fp32), and the transfer fit
    assert scaling.kv.kv_bytes_per_token > 2 * kv_bytes_per_token(str(eos_model_dir))
    assert len(scaling.kv.transfer.state_dict()["observations"]) == len(moves)
    restored = ScalingPolicy(cfg.scaling_knobs())
    restored.load_state_dict(scaling.state_dict())
    assert restored.kv.state_dict() == scaling.kv.state_dict()
    run.release()


class MovingOncePolicy(MovingPolicy):
    """Moves the first paused tail only; later tails resume where they are."""

    moved = False

    def migrate(self, progress, kv_transfer=False):
        moves = [] if self.moved else super().migrate(progress, kv_transfer)[:1]
        self.moved = self.moved or bool(moves)
        return moves


class SourceDiesAfterExportRound(ElasticRound):
    """Kills the source of the first KV move once its export is done and before the
    target's adoption is submitted: the KV exists on the dead worker only."""

    def _move(self, move, path, sent, tag=""):
        if sent is not None and not getattr(self, "killed", None):
            wait(sent)
            assert sent.status == "finished"
            self.killed = move.source
            kill_worker(self.pc, self.pc.address_of(move.source))
        return super()._move(move, path, sent, tag)


class SourceDiesAfterExport(ElasticGeneration):
    round_class = SourceDiesAfterExportRound


@pytest.mark.slow  # a worker killed and restarted: ~15 s
def test_a_source_dying_before_its_kv_is_fetched_loses_nothing(eos_model_dir, tmp_path):
    """The source's export, rerun elsewhere, finds no paused decoding (``TailLost``); the
    move is landed again with the tail recomputed on the target from its cut rows, and the
    iteration ends with every (prompt, sample) once, as uninterrupted decoding."""
    run, facts, *_ = elastic_iteration(eos_model_dir, tmp_path, MovingOncePolicy,
                                    SourceDiesAfterExport)
    (move,) = [d for d in run.read_jsonl("decisions.jsonl") if d["kind"] == "migrate"]
    assert move["path"] == "transfer" and move["landed_by"] == "recompute"
    assert move["bytes"] == 0 and move["landed_sequences"] == move["sequences"]
    assert facts["migrated_sequences"] == move["sequences"]
    run.release()


class MovingPairPolicy(MovingPolicy):
    """``MovingPolicy`` on a pool of two whose idle worker stays: every tail has a target."""

    def plan(self, *args, **kwargs):
        return super().plan(*args, **kwargs | {"min_workers": 2})

    def keeps_alive(self, gap: float) -> bool:
        return True


@pytest.mark.slow
def test_training_on_the_long_tail_task_moves_its_tails_and_logs_them(tmp_path, monkeypatch):
    """The training loop's elastic generation moves every paused tail (the planner's own
    choices are tested in tests/schedulers): each move is logged with its path, seconds and
    bytes, the iterations count the moved sequences, and every (prompt, sample) is once."""
    monkeypatch.setattr(build, "ScalingPolicy", MovingPairPolicy)
    cfg = Config(task="tally-long", runs_dir=str(tmp_path), iterations=2, batch_prompts=12,
                 n_samples=4, max_new_tokens=64, heldout_prompts=4, eval_every=2,
                 policy="elastic", gen_workers=2, lambda_cost=0.5, tau=0.4, keep_alive_s=0.0,
                 train_threads=1)
    run = train(cfg, progress=False, log=lambda *_: None)
    for it in (1, 2):
        table = pq.read_table(run.path / "rollouts" / f"iter-{it:05d}.parquet")
        pairs = Counter(zip(table.column("prompt_id").to_pylist(),
                            table.column("sample_idx").to_pylist()))
        assert len(pairs) == 12 * 4 and set(pairs.values()) == {1}
    moves = [d for d in run.read_jsonl("decisions.jsonl") if d["kind"] == "migrate"]
    assert moves and all(m["reason"].startswith("test: always move") for m in moves), moves
    iterations = [m for m in run.metrics() if m["event"] == "iteration"]
    assert sum(m["migrated_sequences"] for m in iterations) == sum(m["sequences"] for m in moves)
    for move in moves:
        assert move["path"] in ("transfer", "recompute")
        assert move["actual_s"] >= 0 and move["predicted_s"] > 0 and "bytes" in move
        assert move["landed_sequences"] == move["sequences"]