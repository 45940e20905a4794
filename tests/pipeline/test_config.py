from __future__ import annotations

import pytest

from rlhfless.pipeline.config import Config, ConfigError, load_config
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.specs import make_specs


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "exp"\nlr = 0.0003\n[rewards]\nmath500 = "math"\n')
    cfg = load_config(path, ["n_samples=4", "temperature=0.7", 'algorithm="rloo"', "lr=1"])
    assert (cfg.name, cfg.n_samples, cfg.temperature, cfg.algorithm) == ("exp", 4, 0.7, "rloo")
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # an int where a float is expected
    assert cfg.rewards == {"math500": "math"}
    assert load_config(None, ["algorithm=grpo"]).algorithm == "grpo"  # bare string accepted


@pytest.mark.parametrize(
    "override, words",
    [
        ("n_sample=4", ["unknown config key 'n_sample'", "n_samples"]),
        ("algorithm=ppo", ["algorithm", "'ppo'", "grpo", "rloo"]),
        ("n_samples=0", ["n_samples", ">= 1"]),
        ("n_samples=two", ["n_samples", "must be of type int"]),
        ("top_p=1.5", ["top_p"]),
        ("share_prefixes=1", ["share_prefixes", "bool"]),
        ("lr", ["expected key=value"]),
        ("worker_memory=lots", ["worker_memory = 'lots' is not a size", "512 MiB"]),
        ("worker_memory='-1GB'", ["worker_memory = '-1GB'", "too little", "512 MiB"]),
        ("worker_memory='64MiB'", ["worker_memory = '64MiB'", "too little"]),
        ("worker_lifetime='1e400s'", ["worker_lifetime = '1e400s'", "duration"]),
        ("worker_lifetime=soon", ["worker_lifetime = 'soon'", "duration"]),
        ("walltime='0'", ["walltime = '0'", "longer than 0"]),
        ("walltime='tomorrow'", ["walltime = 'tomorrow'", "HH:MM:SS"]),
        ("min_stall_s=0", ["min_stall_s", "> 0"]),
        ("stall_timeout_factor=-1", ["stall_timeout_factor", "> 0"]),
        ("worker_ttl_s=60", ["worker_ttl_s = 60", ">= min_stall_s = 120"]),
        ("connect_timeout_s=5", ["connect_timeout_s = 5", ">= 11"]),
        ("job_start_timeout_s=0", ["job_start_timeout_s", "> 0"]),
        ("gen_min_workers=3", ["gen_min_workers = 3", "from 1 to gen_workers = 2"]),
        ("tail_action=teleport", ["tail_action", "'teleport'", "'split'", "'reconfig'"]),
        ("agent_host=everywhere", ["agent_host = 'everywhere' is not allowed", "'loopback'",
                                   "'worker'"]),
    ],
)
def test_bad_key_or_value_is_one_clear_line(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = = 3")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_a_group_needs_two_samples(algorithm):
    """One sample is its group's mean (GRPO) or has no others to leave out (RLOO): every
    advantage would be 0 and nothing trained."""
    with pytest.raises(ConfigError, match=f"n_samples = 1 must be >= 2 for algorithm = "
                                          f"'{algorithm}'"):
        Config(algorithm=algorithm, n_samples=1)
    assert Config(algorithm=algorithm, n_samples=2).n_samples == 2


def test_the_vllm_engines_memory_share_and_dtype_are_keys():
    cfg = load_config(None, ["gpu_memory_utilization=0.3", "gen_dtype='bfloat16'"])
    assert cfg.gpu_memory_utilization == 0.3 and cfg.gen_dtype == "bfloat16"
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match=r"gpu_memory_utilization = .* must be in \(0, 1\]"):
            load_config(None, [f"gpu_memory_utilization={bad}"])
    with pytest.raises(ConfigError, match="gen_dtype = 'int8': backend 'hf' loads one of auto"):
        load_config(None, ["gen_dtype='int8'"])


def test_top_p_below_one_runs_on_either_engine_and_reaches_the_update(tmp_path):
    """With top_p < 1 the behaviour policy is the nucleus on both engines: the config takes
    it with backend = "vllm" too, and the update recomputes its logprobs over the same
    nucleus; evaluation stays greedy."""
    for backend in ("hf", "vllm"):
        cfg = load_config(None, [f"backend='{backend}'", "top_p=0.9"])
        specs = make_specs(cfg, tmp_path, RunDir(tmp_path / "run"))
        assert specs.gen.sampling.top_p == specs.train.update.top_p == 0.9
        assert specs.eval.sampling.greedy and specs.eval.sampling.top_p == 1.0


def test_colocate_is_refused_in_one_line_without_cuda():
    with pytest.raises(ConfigError, match="colocate = true needs a CUDA device") as err:
        Config(colocate=True, device="cpu")
    assert "\n" not in str(err.value)


def test_a_tail_action_the_backend_cannot_take_is_one_line():
    """vLLM keeps no exportable KV: it stays or recomputes; the emulated engine takes every
    action."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["backend=vllm", "tail_action=split"])
    assert str(err.value) == ("tail_action = 'split': backend 'vllm' can take "
                              "recompute, stay")
    assert load_config(None, ["backend=emulated", "tail_action=split"]).tail_action == "split"
    assert load_config(None, ["tail_action=reconfig"]).tail_action == "reconfig"
