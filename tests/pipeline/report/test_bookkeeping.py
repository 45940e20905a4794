"""What an iteration's rows feed the scheduling policy: their lengths and, where episodes
ran (multi-turn or agents), their seconds outside the model."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rlhfless.pipeline.report.bookkeeping import observe_iteration
from rlhfless.schedulers.scaling_policy import ScalingKnobs, ScalingPolicy

ROWS = {"prompt_id": ["a", "a", "b"], "response_ids": [[1, 2], [1, 2, 3, 4], [5]]}


def test_rows_with_env_seconds_teach_the_predictor_the_time_outside_the_model():
    scaling = ScalingPolicy(ScalingKnobs())
    record = observe_iteration(scaling, pa.table(ROWS | {"env_seconds": [1.0, 3.0, 0.5]}),
                               None)
    assert record["len_pred_mae_env"] == 1.25  # predicted 0 s before it saw them
    np.testing.assert_allclose(scaling.predict_env(["a", "b"]), [2.0, 0.5])
    np.testing.assert_allclose(scaling.predict(["a", "b"])[0], [3.0, 1.0])


def test_rows_without_env_seconds_are_lengths_alone():
    scaling = ScalingPolicy(ScalingKnobs())
    record = observe_iteration(scaling, pa.table(ROWS), None)
    assert not any(key.endswith("_env") for key in record)
    np.testing.assert_allclose(scaling.predict_env(["a", "b", "new"]), [0.0, 0.0, 0.0])
