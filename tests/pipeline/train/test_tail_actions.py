"""Each tail action of the training loop's elastic generation forced once, end to end.

``tail_action`` forces one action at the pool's pause (``tail_actions.py``) on two float64
generation workers (``tail_support.elastic_iteration``): whatever it is, every (prompt,
sample) comes out once, token for token as uninterrupted decoding of the whole batch with
log-probabilities within 1e-5, nothing stays paused on any worker and every worker is back
at its own threads. The decision is a ``decisions.jsonl`` line with every option's
prediction, the action and its actual seconds; a split's or reconfiguration's landings are
lines with their predicted and actual seconds, which the cost models learned; a
reconfiguration releases the workers whose tails it took. The run measured the step
profile it decided from (a ``step_profile`` line). Which action the policy picks unforced is
tested in tests/schedulers/test_tail_choice.py.
"""

from __future__ import annotations

import pytest
from tail_support import elastic_iteration

from rlhfless.ops.engine.engine_types import TAIL_ACTIONS


@pytest.mark.slow
@pytest.mark.parametrize("action", ["stay", "recompute", "split", "reconfig"])
def test_a_forced_tail_action_loses_nothing_and_is_logged(eos_model_dir, tmp_path, action):
    run, facts, scaling, _ = elastic_iteration(eos_model_dir, tmp_path, tail_action=action)
    log = run.read_jsonl("decisions.jsonl")
    (declared,) = [d for d in log if d["kind"] == "tail_actions"]
    assert declared["supported"] == sorted(TAIL_ACTIONS) and declared["refused"] == {}
    (profile,) = [d for d in log if d["kind"] == "step_profile"]
    assert profile["workers"] == 2 and set(profile["median_s"]) >= {"1x1", "16x2"}
    (tail,) = [d for d in log if d["kind"] == "tail"]
    assert tail["action"] == ("move" if action == "recompute" else action), tail
    assert tail["reason"].startswith("forced") and tail["actual_s"] > 0
    assert tail["predicted_s"] > 0 and set(tail["options"]) >= {"stay"}
    landings = [d for d in log if d["kind"] == "tail_move"]
    moves = [d for d in log if d["kind"] == "migrate"]
    if action == "stay":
        assert not landings and not moves and facts["migrated_sequences"] == 0
    elif action == "recompute":
        assert moves and {m["landed_by"] for m in moves} == {"recompute"}
        assert facts["migrated_sequences"] == sum(m["sequences"] for m in moves)
    else:
        (landing,) = landings
        assert landing["action"] == action and landing["moves"]
        sent = sum(m["sequences"] for m in landing["moves"].values())
        assert facts["migrated_sequences"] == sent > 0
        for move in landing["moves"].values():
            assert move["path"] in ("transfer", "recompute") and move["actual_s"] > 0
        observed = scaling.kv.transfer.state_dict()["observations"]
        assert len(observed) == sum(m["path"] == "transfer" for m in landing["moves"].values())
    consolidated = [d["worker"] for d in log if d["kind"] == "release"
                    and "consolidated" in d["reason"]]
    # a reconfiguration's sources are released once their tails landed on its target
    assert consolidated == (list(landing["moves"]) if action == "reconfig" else [])
    run.release()
