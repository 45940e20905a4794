"""Multi-turn rollouts end to end on a real LocalCluster: environments that raise, hang or
return garbage end their own episodes, counted in the metrics, and the run completes."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.train.loop import train


# slow: test_failing_environments_end_only_their_episode (ops/rollouts/test_episode.py)
# checks the same episodes without a cluster in the quick suite
@pytest.mark.parametrize("policy, mode", [
    pytest.param("static", "sync", marks=pytest.mark.slow),
    pytest.param("elastic", "sync", marks=pytest.mark.slow),
    pytest.param("static", "async", marks=pytest.mark.slow),
])
def test_failing_environments_do_not_stop_the_run(tiny_model_dir, tmp_path, policy, mode):
    # the quick model's prompts carry their count as answer: Faulty reads it as the fault
    # to show; rows with a plain count behave. So every batch mixes faults and good rows.
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), iterations=2,
                 batch_prompts=6, n_samples=2, heldout_prompts=4, eval_every=2,
                 gen_workers=2, train_threads=1, policy=policy, mode=mode,
                 environment="episode_envs:Faulty", env_kwargs={"turns": 2},
                 max_turns=3, max_turn_tokens=12, max_episode_tokens=60,
                 env_step_timeout_s=1.0, dataset=str(tmp_path / "train.jsonl"),
                 heldout=str(tiny_model_dir / "heldout.jsonl"))
    lines = [(f'{{"prompt_id": "q{i}", "prompt": "Items: fig pear\\nAnswer:", '
              f'"answer": "{fault}", "data_source": "tally"}}')
             for i, fault in enumerate(["raise", "hang", "garbage", "bad-reset", "2", "3"])]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    run = train(cfg, progress=False, log=lambda *_: None)
    iterations = [m for m in run.metrics() if m.get("event") == "iteration"]
    assert [m["iteration"] for m in iterations] == [1, 2]
    for m in iterations:
        assert m["episodes"] == 12
        assert m["env_errors"] >= 2  # bad-reset always; the others when a turn ends at EOS
        assert m["episodes_error"] == m["env_errors"]
    table = pq.read_table(run.path / "rollouts" / "iter-00001.parquet").to_pylist()
    bad = [r for r in table if r["answer"] == "bad-reset"]
    assert all(r["finish_reason"] == "error" and "reset returned int" in r["env_error"]
               for r in bad)
    assert all(len(r["loss_mask"]) == len(r["response_ids"]) for r in table)
    assert all(r["env_error"] is None for r in table if r["answer"] in ("2", "3"))


def test_environment_config_is_checked():
    with pytest.raises(ConfigError, match="environment = 'nope'"):
        Config(environment="nope")
    with pytest.raises(ConfigError, match="max_turns"):
        Config(environment="python", max_turns=0)
    with pytest.raises(ConfigError, match="turn_credit = 'return_to_go' credits the turns"):
        Config(turn_credit="return_to_go")  # no environment: no turns
    with pytest.raises(ConfigError, match="turn_credit = 'turn'"):
        Config(environment="python", turn_credit="turn")
    assert Config(task="tally-tool").episode_environment == "tally-tool"
    assert Config().episode_environment == ""


@pytest.mark.slow
def test_turn_credit_reaches_the_trainer(tiny_model_dir, tmp_path):
    """``turn_credit = "return_to_go"``: every trained row has one turn advantage per run of
    generated tokens, the first its sequence advantage (turn 0's return is the episode's
    reward), the second GRPO of the second turn's reward among the group's second turns."""
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), iterations=1,
                 environment="episode_envs:Graded", env_kwargs={"turns": 2},
                 step_cut_turns=True, batch_prompts=4, n_samples=4,
                 heldout_prompts=4, max_turns=2, max_turn_tokens=8, max_episode_tokens=60,
                 eval_every=1, gen_workers=1, train_threads=1, policy="static",
                 turn_credit="return_to_go")
    run = train(cfg, progress=False, log=lambda *_: None)
    table = pq.read_table(run.path / "rollouts" / "iter-00001.parquet").to_pylist()
    assert len(table) == 16
    for row in table:
        mask = row["loss_mask"]
        runs = sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] != 1))
        assert len(row["turn_advantage"]) == runs
        if runs == row["turns"]:
            assert row["turn_advantage"][0] == pytest.approx(row["advantage"], abs=1e-6)
    assert all(len(r["turn_rewards"]) == 2 == len(r["turn_advantage"]) for r in table)
    for group in {r["prompt_id"] for r in table}:
        rows = [r for r in table if r["prompt_id"] == group]
        second = np.array([r["turn_rewards"][1] for r in rows])
        want = (second - second.mean()) / (second.std(ddof=1) + 1e-6) if np.ptp(second) else \
            np.zeros(len(rows))
        assert [r["turn_advantage"][1] for r in rows] == pytest.approx(want, abs=1e-5)
    assert any(r["turn_advantage"][1] != 0 for r in table)
    iteration = next(m for m in run.metrics() if m.get("event") == "iteration")
    assert iteration["tokens"] > 0
