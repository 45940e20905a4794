"""The split of one machine's cores between generation workers and trainer threads when the
two overlap (async modes): the fewest-seconds split that fits, what was asked when it fits."""

from __future__ import annotations

import pytest

from rlhfless.pipeline.cluster.pools import fit_overlap
from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.schedulers.pool_split import split_for_overlap


def _split(*args, **kw) -> tuple[int, int]:
    s = split_for_overlap(*args, **kw)
    return s.gen_workers, s.train_threads


def test_the_default_pool_on_two_cores_becomes_one_worker_and_one_thread():
    assert _split(2, 1, 2, 2) == (1, 1)  # 2 x 1 + 2 threads asked; 2 cores


def test_a_pool_that_fits_is_kept():
    assert _split(4, 1, 2, 2) == (2, 2)
    assert split_for_overlap(16, 1, 2, 2).reason.startswith("as asked")


def test_the_split_follows_the_work_share():
    # 3 cores for 2 + 2: one pool gets 2, the one with more work (a tie: generation)
    assert _split(3, 1, 2, 2, gen_share=0.8) == (2, 1)
    assert _split(3, 1, 2, 2, gen_share=0.2) == (1, 2)
    assert _split(3, 1, 2, 2) == (2, 1)
    # 8 cores, 6 + 6 asked: seconds max(0.75 / g, 0.25 / t) least at g = 6, t = 2
    assert _split(8, 1, 6, 6, gen_share=0.75) == (6, 2)


def test_threads_of_generation_workers_and_trainer_ranks_count():
    assert _split(4, 2, 2, 2) == (1, 2)  # a worker of 2 threads: 2 + 2 fits, 4 + 1 does not
    assert _split(4, 1, 2, 2, train_ranks=2) == (2, 1)  # 2 + 2 x 1
    assert _split(2, 2, 2, 2) == (1, 1)  # nothing fits: the smallest
    assert split_for_overlap(2, 2, 2, 2).reason.startswith("the smallest")


@pytest.mark.parametrize("kw", [{"cores": 0}, {"gen_threads": 0}, {"max_gen_workers": 0},
                                {"max_train_threads": 0}, {"train_ranks": 0},
                                {"gen_share": 1.0}, {"gen_share": 0.0}])
def test_bad_arguments_are_refused(kw):
    args = {"cores": 2, "gen_threads": 1, "max_gen_workers": 2, "max_train_threads": 2} | kw
    with pytest.raises(ValueError, match=next(iter(kw))):
        split_for_overlap(**args)


def test_only_async_runs_on_this_machines_cpu_are_split():
    async_cpu = Config(mode="async", device="cpu", gen_workers=64, train_threads=64)
    fitted, split = fit_overlap(async_cpu)
    assert split is not None and split.gen_workers + split.train_threads <= split.cores
    assert (fitted.gen_workers, fitted.train_threads) == (split.gen_workers,
                                                          split.train_threads)
    for cfg in (Config(mode="sync", device="cpu", gen_workers=64),
                Config(mode="replay", device="cpu", gen_workers=64),
                Config(mode="async", device="cpu", gen_workers=64, overlap_pools="as_set"),
                Config(mode="async", device="cpu", gen_workers=64, cluster="slurm"),
                Config(mode="async", device="cuda", gen_workers=64),
                Config(mode="async", device="cpu", gen_workers=64, backend="emulated")):
        assert fit_overlap(cfg) == (cfg, None)


def test_overlap_pools_is_checked():
    with pytest.raises(ConfigError, match="overlap_pools"):
        Config(overlap_pools="all")
