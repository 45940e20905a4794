"""The run configuration: one flat dataclass, read from TOML, overridable per key.

``load_config("run.toml", ["lr=3e-4", "n_samples=16"])`` gives a validated ``Config``; a bad
key or value raises ``ConfigError`` with one line that names it and what is allowed.
Override values are parsed as TOML (``3e-4``, ``true``, ``"text"``, ``[1, 2]``), falling back
to a bare string. The ``[rewards]`` table maps a ``data_source`` to a built-in verifier
(``math``, ``exact``) or to a user function ``"package.module:function"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import tomllib
from dask.utils import parse_bytes, parse_timedelta
from fsspec import available_protocols, get_filesystem_class
from fsspec.core import split_protocol

from rlhfless.ops.engine.engine_types import TAIL_ACTIONS
from rlhfless.ops.engine.registry import check_engine, engine_class
from rlhfless.ops.engine.vllm_lora import check_vllm_lora
from rlhfless.ops.rollouts.adapters import DATASET_ADAPTERS, adapter_of
from rlhfless.ops.rollouts.agent_binding import AGENT_HOSTS
from rlhfless.ops.rollouts.agent_http import check_agent_url, is_agent_url, service_trust
from rlhfless.ops.rollouts.env import BUILTIN_AGENTS, BUILTIN_ENVIRONMENTS
from rlhfless.ops.rollouts.env_prompts import HELDOUT_SEED
from rlhfless.schedulers.scaling_policy import ScalingKnobs
from rlhfless.schedulers.sim.workloads import WORKLOADS

from .report.trackers.names import check_report_to

CHOICES = {
    "algorithm": ("grpo", "rloo"),
    "mode": ("sync", "async", "replay", "async+replay"),
    "replay_share": ("fixed", "adaptive"),
    "policy": ("static", "elastic"),
    "assignment": ("length", "round_robin"),
    "cluster": ("local", "slurm", "pbs"),
    "device": ("auto", "cpu", "cuda"),
    "on_bad_row": ("error", "skip"),
    "nonfinite_policy": ("stop", "skip"),
    "on_collapse": ("warn", "rollback", "stop"),
    "on_long_prompt": ("error", "truncate", "skip"),
    "train_parallel": ("fsdp", "ddp"),
    "train_dtype": ("float32", "bfloat16"),
    "task": ("tally", "tally-tool", "tally-long"),
    "agent_host": AGENT_HOSTS,
    "overlap_pools": ("fit_cores", "as_set"),
    "weight_store": ("run", "cluster"),
    "emulate_workload": tuple(WORKLOADS),
    "tail_action": ("auto", *TAIL_ACTIONS),
}

KNOBS = ScalingKnobs()
# keys renamed since a run's config.json was written: old name -> new name
RENAMED = {"tau_migrate": "tau"}

# a run name is one path component: runs/<name>/ never points outside runs/
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# the least worker_memory: a worker process holds ~250 MiB once torch is imported, before any
# task, and Dask pauses a worker at 80 % of its limit, so below this it would never run one
MIN_WORKER_MEMORY = 512 << 20


class ConfigError(ValueError):
    """A bad key or value in the configuration; the message is one actionable line."""


SECURITY_KEYS: dict[str, type] = {
    "enabled": bool, "require_encryption": bool, "tls_ca_file": str, "tls_ciphers": str,
    "tls_client_cert": str, "tls_client_key": str, "tls_scheduler_cert": str,
    "tls_scheduler_key": str, "tls_worker_cert": str, "tls_worker_key": str,
}


def check_security(section: Mapping[str, Any]) -> None:
    """``ValueError`` (one line) for an unknown key, a value of the wrong type, or settings
    given together with ``enabled = false``."""
    for key, value in section.items():
        kind = SECURITY_KEYS.get(key)
        if kind is None:
            raise ValueError(f"security key {key!r} is not a security setting; known: "
                             f"{', '.join(sorted(SECURITY_KEYS))}")
        if not isinstance(value, kind):
            raise ValueError(f"security.{key} = {value!r} must be of type {kind.__name__}")
    if section.get("enabled") is False and len(section) > 1:
        others = sorted(k for k in section if k != "enabled")
        raise ValueError(f"security.enabled = false turns TLS off, but {others} are set; "
                         "remove one or the other")


def one_line(check, *args) -> None:
    """``check(*args)``, its ``ValueError`` (already one line) raised as a ``ConfigError``."""
    try:
        check(*args)
    except ValueError as err:
        raise ConfigError(str(err)) from None


@dataclass(frozen=True)
class Config:
    # run
    name: str = "tiny"  # runs/<name>/ holds everything the run writes
    runs_dir: str = "runs"  # the folder of run directories
    seed: int = 0  # seeds prompt order, sampling and the elastic policy's draws
    iterations: int = 30  # training iterations (one batch, one update each)
    checkpoint_every: int = 5  # iterations between checkpoints (and one after the last)
    keep_checkpoints: int = 2  # whole checkpoints kept on disk, newest first
    max_recoveries: int = 3  # trainer losses a run recovers from before it gives up
    nonfinite_policy: str = "stop"  # a NaN/inf loss: "stop" the run or "skip" that batch
    # the collapse guard (pipeline/train/guard.py): held-out accuracy, or the training reward
    # while the responses lengthen, falling collapse_drop below its peak
    on_collapse: str = "rollback"  # back to the last good checkpoint; "warn" (say), "stop"
    collapse_drop: float = 0.1  # a fall this far below the peak is a collapse
    collapse_length_growth: float = 1.5  # reward falls count at this x the peak's response length
    rollback_lr_factor: float = 0.5  # on_collapse = "rollback": lr x this after each rollback
    max_rollbacks: int = 3  # rollbacks before the run stops with the collapse
    # model and data ("tiny": the embedded default, built locally on first use)
    model: str = "tiny"  # "tiny" or a Hugging Face model directory
    tiny_context: int = 0  # the tiny model's context in tokens, its weights as built (RoPE); 0: 256
    dataset: str = ""  # RL prompts: .jsonl/.json/.parquet, "reasoning-gym:<task>"; "": tiny
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)  # reasoning-gym: size, seed, cfg
    heldout: str = ""  # prompts for evaluation; empty: a split of dataset (or the tiny task's)
    heldout_prompts: int = 256  # evaluate on at most N held-out prompts
    eval_every: int = 5  # iterations between held-out evaluations (and after the last)
    max_prompt_tokens: int = 192  # the longest prompt, in tokens (see on_long_prompt)
    on_bad_row: str = "error"  # a malformed row: "error" names it, "skip" counts it
    on_long_prompt: str = "skip"  # over max_prompt_tokens: "error", "truncate" or "skip"
    require_answers: bool = True  # a prompt without ground truth is a bad row
    prompt_key: str = "prompt"  # your files' prompt column (veRL's data.prompt_key)
    answer_key: str = ""  # your files' ground truth, dotted if nested; "": the formats' own
    task: str = "tally"  # model = "tiny": tally, tally-tool (multi-turn) or tally-long
    # multi-turn rollouts (ops/rollouts/episode.py): on when environment is set (or task needs one)
    # "python", "tally-tool", "skyrl-gym:<id>", "textarena:<env id>", "gymnasium:<module>:<id>"
    # or "module:Class"
    environment: str = ""  # the multi-turn environment (see above); empty: single-turn
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the environment
    env_prompts: int = 0  # > 0, no dataset: N prompts per epoch, environment's reset, seeds 0..N-1
    # data_source -> an environment name, or {environment = name, env_kwargs = {...}}
    environments: dict[str, Any] = field(default_factory=dict)  # per data_source (see above)
    max_turns: int = 4  # model turns per episode
    max_turn_tokens: int = 64  # tokens the model generates per turn
    max_episode_tokens: int = 192  # generated + observation tokens after the prompt
    env_step_timeout_s: float = 10.0  # per environment call; over it ends the episode
    step_cut_turns: bool = False  # a turn cut at max_turn_tokens goes to the environment too
    # agent episodes (ops/rollouts/agent.py): "module:function" or "tally-agent" (the embedded
    # one, on task tally-tool), called per prompt with an OpenAI client of the worker's endpoint;
    # or "http(s)://host:port/path", an agent service each episode is POSTed to (agent_http.py)
    agent: str = ""  # empty: no agent
    agent_timeout_s: float = 60.0  # per agent episode; over it ends the episode as an error
    agent_concurrency: int = 64  # agent episodes at once per generation worker (each shard)
    agent_processes: int = 2  # processes a shard's agent episodes are spread over (in parallel)
    agent_chat_template: str = ""  # a Jinja chat template file for the endpoint; "": tokenizer's
    agent_host: str = "loopback"  # endpoint on loopback, or worker: its Dask address (TLS: HTTPS)
    agent_ca_file: str = ""  # PEM: the https agent service's only authority; "": the system's
    agent_lr_factor: float = 0.5  # agents' episodes update at lr x this (docs/agents.md)
    # algorithm
    algorithm: str = "grpo"  # advantage estimator: grpo (group z-score) or rloo
    # episodes' credit (ops/algo/advantage.py): normalised among the group's same-index turns
    turn_credit: str = "episode"  # episode: every turn the episode's; return_to_go: its own onward
    batch_prompts: int = 32  # prompts per iteration
    n_samples: int = 8  # responses per prompt (the group)
    max_new_tokens: int = 64  # tokens generated per response
    temperature: float = 1.0  # sampling temperature of generation and of the loss
    top_p: float = 1.0  # nucleus sampling threshold (1: off)
    lr: float = 5e-4  # learning rate (2e-3 collapsed the tiny model in some seeds)
    clip_eps: float = 0.2  # PPO ratio clip
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy
    epochs: int = 1  # optimizer steps per batch
    micro_batch_tokens: int = 8192  # tokens per forward/backward micro-batch
    max_grad_norm: float = 1.0  # gradient clipping norm
    rewards: dict[str, str] = field(  # data_source -> math, exact, reasoning-gym:<task>, mod:fn
        default_factory=lambda: {"tally": "exact"})
    default_reward: str = "math"  # the verifier of a data_source not in rewards
    reward_timeout_s: float = 5.0  # per reward call; over it gets reward_fallback
    reward_fallback: float = 0.0  # the reward of a response whose reward failed
    share_prefixes: bool = True  # prompts that share a token prefix compute it once
    min_prefix: int = 4  # shortest token prefix worth sharing across prompts
    # execution
    # sync | async (bounded staleness) | replay (experience replay) | async+replay (both)
    mode: str = "sync"  # sync, async, replay or async+replay
    max_staleness: int = 1  # async: versions a sample may lag the trainer that consumes it
    # stale samples take smaller steps: at 1, async ended 0.03 below sync (docs/modes.md)
    off_policy_lr_factor: float = 0.5  # not sync: the update's learning rate is lr x this
    tis_cap: float = 2.0  # not sync: cap of the importance weight pi_prox / pi_behaviour
    replay_ratio: float = 0.5  # replay: fraction of each batch's groups taken from the buffer
    replay_max_age: int = 0  # replay: a group older than this many versions is not replayed;
    # 0: the least that replays, 2 (async+replay: 2 * max_staleness + 1)
    replay_size: int = 64  # replay: the most groups the buffer holds
    replay_share: str = "fixed"  # fixed: replay_ratio always; adaptive: by gen/update balance
    replay_age_decay: float = 1.0  # replay: a group's draw weight shrinks by this per version
    replay_max_grad_share: float = 0.5  # replay: most replayed share of informative groups
    replay_longest: bool = False  # replay: replace the prompts predicted longest (costs accuracy)
    replay_max_skips: int = 1  # replay_longest: most draws in a row a prompt is replaced at
    max_wall_s: float = 0.0  # training seconds; stop after the iteration past them (0: none)
    keep_weights: int = 2  # published versions kept (async: >= max_staleness + 2)
    weight_store: str = "run"  # where versions go: run (files all workers read) | cluster | URL
    # cluster: held by the trainer, fetched worker to worker over Dask's comms; an fsspec URL,
    # "s3://bucket/prefix": written there, copied by each worker (either: no shared disk)
    # secrets not here (config.json keeps these): in the environment, as fsspec reads them
    weight_store_options: dict[str, Any] = field(  # a URL store's fsspec storage options
        default_factory=dict)
    policy: str = "static"  # generation workers: static (gen_workers) or elastic (cost model)
    backend: str = "hf"  # generation engine: hf (our decode loop) | vllm (vLLM, an extra) |
    # emulated (a GPU profile's clock, docs/emulated.md) | a registered name
    # (ops/engine/registry.py) | "module:Class" of your own
    colocate: bool = False  # vllm engines sleep between rollouts, freeing the trainer's GPU
    gen_dtype: str = "auto"  # generation engine's weights: auto (bf16 on CUDA, float32 on CPU)
    # vllm on CPU: of its NUMA node's RAM, the worker's own memory included; raise it on a GPU
    gpu_memory_utilization: float = 0.15  # share of device memory each vllm engine takes
    # backend = "emulated" (pipeline/train/emulation.py): a GPU profile's task times on a
    # workload trace's prompts and lengths
    emulate_profile: str = "Qwen2.5-3B@L40S"  # a built-in profile (schedulers/profiles.py)
    emulate_time_scale: float = 0.05  # wall seconds per emulated second
    emulate_workload: str = "gsm8k"  # the trace's lengths (schedulers/sim/workloads.py)
    emulate_train_gpus: int = 16  # the emulated learner's GPUs
    cluster: str = "local"  # where workers run: local processes, slurm or pbs jobs
    device: str = "auto"  # auto (cuda if present), cpu or cuda
    gen_workers: int = 2  # generation pool size; the most the elastic policy may start
    gen_min_workers: int = 1  # the fewest generation workers the elastic policy plans
    # the elastic policy's priors of what weights cost a worker (schedulers/weight_costs.py),
    # at the model's size, until the run measures its own cold starts and fetches
    engine_start_s: float = 30.0  # a cold start's part that is not the base weights' read
    weight_load_gbs: float = 1.0  # GB/s a new worker reads the base weights at
    weight_fetch_gbs: float = 1.0  # GB/s of a version's publish + fetch end to end
    # elastic scheduling (policy = "elastic"; static keeps gen_workers for the whole run):
    # the knobs of schedulers/scaling_policy.py ScalingKnobs, with its defaults and reasons
    lambda_cost: float = KNOBS.lambda_cost
    tau: float = KNOBS.tau
    # the pool's paused tails at tau: the policy chooses (docs/long-tail.md), or one action
    # forced whatever it costs: stay | kv | recompute (every tail moves) | split | reconfig
    tail_action: str = "auto"  # auto, or an action the backend can take, at every pause
    assignment: str = KNOBS.assignment
    keep_alive_s: float = KNOBS.keep_alive_s
    ewma_alpha: float = KNOBS.ewma_alpha
    prices: dict[str, float] = field(  # price per worker-second of each pool
        default_factory=lambda: {"gen": 1.0, "train": 1.0})
    gen_threads: int = 1  # torch threads per generation worker
    train_threads: int = 2  # torch threads of the trainer (resource TRAIN=1)
    # async modes on a local CPU cluster: at most gen_workers generation workers and
    # train_threads trainer threads, as many as fit the cores together (schedulers/pool_split.py)
    overlap_pools: str = "fit_cores"  # fit_cores, or as_set: the pools as set
    train_workers: int = 1  # trainer ranks: > 1 forms one torch.distributed group over them
    train_parallel: str = "fsdp"  # train_workers > 1: fsdp (FSDP2 shards) | ddp (replicas)
    train_dtype: str = "float32"  # bfloat16: bf16 autocast forward/backward, fp32 master weights
    # gradient_checkpointing: rows then run whole (no shared-prompt forward; ops/engine/forward.py)
    gradient_checkpointing: bool = False  # recompute layers in backward: less memory, slower
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank only (peft; the lora extra)
    lora_alpha: float = 16.0  # LoRA scale alpha / lora_rank
    lora_target_modules: list[str] = field(  # module names that get adapters
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    worker_memory: str = "4GiB"  # per worker process, a size as Dask reads it ("4GiB", "500MB")
    # a generation task that shows no progress (decode steps) for longer than
    # stall_timeout_factor x its predicted duration + min_stall_s is a lost worker: restarted
    stall_timeout_factor: float = 10.0  # stall deadline / predicted duration (generous)
    min_stall_s: float = 120.0  # floor of the stall deadline: a first task has no prediction
    # a worker with no heartbeat for worker_ttl_s is lost, whatever its tasks' deadlines
    worker_ttl_s: float = 300.0  # >= min_stall_s; Dask's worker-ttl too (its default)
    # Dask's comm timeouts connect and tcp: a host cut off loses its connections by then
    connect_timeout_s: float = 30.0  # s a connection may take to open or go unacknowledged
    scheduler_host: str = "127.0.0.1"  # where the scheduler listens (never all, unless asked)
    dashboard: bool = False  # serve Dask's dashboard: plain HTTP any local user can read
    dashboard_address: str = "127.0.0.1:0"  # where it listens when dashboard = true
    # trackers that get every metric (docs/watching.md); []: none
    report_to: list[str] = field(  # tensorboard, wandb, mlflow, trackio; auto: tb if installed
        default_factory=lambda: ["auto"])
    run_umask: int = 0o077  # files of a run 0600, its dirs 0700; 0o022 shares them read-only
    security: dict[str, Any] = field(default_factory=dict)  # TLS of the cluster (security.py)
    # batch jobs (cluster = "slurm" | "pbs"): one job per worker, per-pool directives
    queue: str = ""  # Slurm partition / PBS queue; empty: the site's default
    account: str = ""  # charged account (-A); empty: the site's default
    walltime: str = "01:00:00"  # of every job; workers leave before it (worker_lifetime)
    worker_lifetime: str = ""  # dask worker --lifetime, e.g. "55m"; empty: 90% of walltime
    interface: str = ""  # network interface of scheduler and workers, e.g. "ib0"
    job_prologue: list[str] = field(default_factory=list)  # shell lines, e.g. "module load cuda"
    gen_gpus: int = 0  # GPUs per generation job (--gres=gpu:N)
    train_gpus: int = 0  # GPUs of the trainer's job
    gen_job_directives: list[str] = field(default_factory=list)  # e.g. ["--constraint=a100"]
    train_job_directives: list[str] = field(default_factory=list)  # of the trainer's job
    job_start_timeout_s: float = 600.0  # a job not running a worker by then is an error

    def __post_init__(self) -> None:
        """Every value checked; a bad one is a ``ConfigError`` of one line naming its key."""
        self._check_name_and_choices()
        self._check_numbers()
        self._check_algorithm()
        self._check_cluster()
        self._check_engine()
        self._check_episodes()

    def _check_name_and_choices(self) -> None:
        if not RUN_NAME.fullmatch(self.name):
            raise ConfigError(f"name = {self.name!r} is not allowed: a run name is one path "
                              "component of letters, digits, '.', '_' and '-' that starts with "
                              "a letter or digit (at most 128 characters)")
        for key, allowed in CHOICES.items():
            value = getattr(self, key)
            if key == "weight_store" and "://" in value:
                check_weight_url(value)
            elif value not in allowed:
                raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {allowed}"
                                  + (" or an fsspec URL such as 's3://bucket/prefix'"
                                     if key == "weight_store" else ""))
        if self.weight_store_options and "://" not in self.weight_store:
            raise ConfigError(f"weight_store_options = {self.weight_store_options} are the "
                              "storage options of a URL store; weight_store = "
                              f"{self.weight_store!r} takes none: remove them")

    def _check_numbers(self) -> None:
        positive = ("iterations", "batch_prompts", "n_samples", "max_new_tokens", "gen_workers",
                    "gen_threads", "train_threads", "train_workers", "epochs", "micro_batch_tokens",
                    "heldout_prompts", "eval_every", "max_prompt_tokens", "max_turns",
                    "max_turn_tokens", "max_episode_tokens", "agent_concurrency", "agent_processes",
                    "emulate_train_gpus")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} = {getattr(self, key)} must be >= 1")
        if not 1 <= self.gen_min_workers <= self.gen_workers:
            raise ConfigError(f"gen_min_workers = {self.gen_min_workers} must be from 1 to "
                              f"gen_workers = {self.gen_workers}")
        for key in ("temperature", "lr", "reward_timeout_s", "env_step_timeout_s",
                    "agent_timeout_s",
                    "emulate_time_scale", "stall_timeout_factor", "min_stall_s",
                    "weight_load_gbs", "weight_fetch_gbs"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} = {getattr(self, key)} must be > 0")
        if not self.engine_start_s >= 0:
            raise ConfigError(f"engine_start_s = {self.engine_start_s} must be >= 0")
        one_line(self.scaling_knobs)
        if set(self.prices) != {"gen", "train"}:
            raise ConfigError(f"prices = {self.prices} must price exactly the pools gen, train")
        if not 0 < self.collapse_drop <= 1 or not self.collapse_length_growth >= 1:
            raise ConfigError(f"collapse_drop = {self.collapse_drop} must be in (0, 1] and "
                              f"collapse_length_growth = {self.collapse_length_growth} >= 1")
        if not 0 < self.rollback_lr_factor < 1:
            raise ConfigError(f"rollback_lr_factor = {self.rollback_lr_factor} must be in "
                              "(0, 1): a rollback goes on with a lower learning rate")
        if not 0 < self.agent_lr_factor <= 1:
            raise ConfigError(f"agent_lr_factor = {self.agent_lr_factor} must be in (0, 1]")
        if not 0 < self.off_policy_lr_factor <= 1:
            raise ConfigError(f"off_policy_lr_factor = {self.off_policy_lr_factor} must be in "
                              "(0, 1]: the modes other than sync update at lr x this (1: lr)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.kl_coef < 0 or self.clip_eps <= 0:
            raise ConfigError("kl_coef must be >= 0 and clip_eps > 0")
        for key, least in (("checkpoint_every", 1), ("keep_checkpoints", 1),
                           ("max_recoveries", 0), ("max_rollbacks", 0)):
            if getattr(self, key) < least:
                raise ConfigError(f"{key} = {getattr(self, key)} must be >= {least}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization = {self.gpu_memory_utilization} must be "
                              "in (0, 1]: the share of memory each vllm engine takes")
        if self.tiny_context < 0:
            raise ConfigError(f"tiny_context = {self.tiny_context} must be >= 0 (0: the tiny "
                              "model's context as built)")
        if not self.connect_timeout_s >= 11 or not self.worker_ttl_s >= self.min_stall_s:
            raise ConfigError(f"connect_timeout_s = {self.connect_timeout_s} must be >= 11 (Dask "
                              "probes a silent connection 10 times, a second apart at least) "
                              f"and worker_ttl_s = {self.worker_ttl_s} >= min_stall_s = "
                              f"{self.min_stall_s} (the stall deadline's floor)")

    def _check_algorithm(self) -> None:
        if self.turn_credit not in ("episode", "return_to_go"):
            raise ConfigError(f"turn_credit = {self.turn_credit!r}: allowed 'episode', "
                              "'return_to_go'")
        if self.turn_credit == "return_to_go" and (
                self.algorithm != "grpo" or not (self.episode_environment
                                                 or self.environments or self.agent)):
            raise ConfigError("turn_credit = 'return_to_go' credits the turns of episodes: it "
                              "needs algorithm = 'grpo' and an environment or agent")
        if self.n_samples < 2:  # one sample is its group's mean: every advantage is 0
            raise ConfigError(f"n_samples = {self.n_samples} must be >= 2 for algorithm = "
                              f"{self.algorithm!r}: a group of one sample has advantage 0, "
                              "so nothing would be trained")
        check_mode(self)

    def _check_cluster(self) -> None:
        """Batch jobs, security, trackers, file modes."""
        if self.gen_gpus < 0 or self.train_gpus < 0:
            raise ConfigError("gen_gpus and train_gpus must be >= 0")
        if not 0 < self.job_start_timeout_s < math.inf:
            raise ConfigError(f"job_start_timeout_s = {self.job_start_timeout_s} must be a "
                              "number of seconds > 0")
        try:
            if walltime_seconds(self.walltime) == 0:
                raise ValueError(f"walltime = {self.walltime!r} must be longer than 0")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            lifetime = parse_timedelta(self.worker_lifetime or "0s")
        except (ValueError, KeyError, OverflowError):
            raise ConfigError(f"worker_lifetime = {self.worker_lifetime!r}: use a duration "
                              "such as '55m' or '3300s'") from None
        memory_bytes(self.worker_memory)
        if lifetime >= walltime_seconds(self.walltime):
            raise ConfigError(f"worker_lifetime = {self.worker_lifetime!r} must be shorter than "
                              f"walltime = {self.walltime!r}: workers leave before the batch "
                              "system ends their jobs")
        if not 0 <= self.run_umask <= 0o077:
            raise ConfigError(f"run_umask = {self.run_umask:#o} must be a umask from 0o000 to "
                              "0o077 (the run's own user must keep reading and writing its "
                              "files), e.g. 0o077 (private) or 0o022 (readable by all)")
        one_line(check_security, self.security)
        one_line(check_report_to, self.report_to)

    def _check_engine(self) -> None:
        if self.colocate and (self.device == "cpu" or not cuda_available()):
            raise ConfigError("colocate = true needs a CUDA device: vLLM's sleep mode, which "
                              "frees the device for the trainer, does not run on CPU")
        if self.lora_rank < 0 or self.lora_rank and not (self.lora_alpha > 0
                                                         and self.lora_target_modules):
            raise ConfigError(f"lora_rank = {self.lora_rank} must be >= 0 (0: no LoRA), with "
                              "lora_alpha > 0 and at least one of lora_target_modules")
        one_line(check_engine, self.backend, self.gen_dtype)
        if self.tail_action != "auto":
            actions = engine_class(self.backend).tail_actions  # imports the engine's module
            if self.tail_action not in actions:
                raise ConfigError(f"tail_action = {self.tail_action!r}: backend "
                                  f"{self.backend!r} can take {', '.join(sorted(actions))}")
        if self.lora_rank and self.backend == "vllm":
            try:
                check_vllm_lora(self.lora_rank, self.lora_target_modules)
            except ValueError as err:
                raise ConfigError(f"backend = 'vllm': {err}") from None

    def _check_episodes(self) -> None:
        """Environments, datasets, agents."""
        if self.environment and ":" not in self.environment \
                and self.environment not in BUILTIN_ENVIRONMENTS:
            raise ConfigError(f"environment = {self.environment!r}: use one of "
                              f"{sorted(BUILTIN_ENVIRONMENTS)}, 'skyrl-gym:<id>', "
                              "'textarena:<env id>', 'gymnasium:<module>:<id>' or "
                              "'package.module:Class'")
        if not self.prompt_key:
            raise ConfigError("prompt_key = '' names no column; give the column of the prompt "
                              "(default 'prompt')")
        if self.dataset_kwargs and not dataset_task(self.dataset):
            raise ConfigError(f"dataset_kwargs = {self.dataset_kwargs} is for a dataset "
                              "'reasoning-gym:<task>', not a file; remove it")
        self.environment_routes()  # raises for a malformed [environments] entry
        check_env_prompts(self)
        if self.agent and is_agent_url(self.agent):
            try:
                check_agent_url(self.agent)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        elif self.agent and ":" not in self.agent and self.agent not in BUILTIN_AGENTS:
            raise ConfigError(f"agent = {self.agent!r}: use 'module:function', an agent "
                              f"service's http(s):// URL or one of {sorted(BUILTIN_AGENTS)}")
        if self.agent and (self.environment or self.environments):
            raise ConfigError(f"agent = {self.agent!r} plays its own episodes: remove "
                              "environment / environments, or the agent")
        if self.agent_ca_file and not self.agent.lower().startswith("https://"):
            raise ConfigError(f"agent_ca_file = {self.agent_ca_file!r} is the authority of an "
                              f"https:// agent service; agent = {self.agent!r} is none")
        self.agent_service_ca()  # raises for a file that cannot be read or holds no certificate

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name

    @property
    def episode_environment(self) -> str:
        """The environment of multi-turn rollouts ("": single-turn generation)."""
        if self.environment:
            return self.environment
        if self.agent:  # the agent plays the episodes
            return ""
        return "tally-tool" if self.task == "tally-tool" and self.model == "tiny" else ""

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are episodes: an environment, for every row or for some sources."""
        return bool(self.episode_environment or self.environments)

    def agent_service_ca(self) -> str | None:
        """The PEM text of ``agent_ca_file`` (None: unset); ``ConfigError`` when the file
        cannot be read or holds no certificate."""
        if not self.agent_ca_file:
            return None
        try:
            text = Path(self.agent_ca_file).read_text()
            service_trust(text)
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"agent_ca_file = {self.agent_ca_file!r} cannot be read: "
                              f"{getattr(err, 'strerror', None) or 'not text'}") from None
        except (ssl.SSLError, ValueError):
            raise ConfigError(f"agent_ca_file = {self.agent_ca_file!r} holds no PEM "
                              "certificate; give the authority's certificate as PEM") from None
        return text

    def environment_routes(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """``environments`` as ``{data_source: (environment, env_kwargs)}``; ``ConfigError``
        naming an entry that is neither a name nor ``{environment, env_kwargs}``."""
        routes = {}
        for source, entry in self.environments.items():
            name, kwargs = (entry, {}) if isinstance(entry, str) else (
                (entry.get("environment"), entry.get("env_kwargs", {}))
                if isinstance(entry, dict) and set(entry) <= {"environment", "env_kwargs"}
                else (None, None))
            if not isinstance(name, str) or not name or not isinstance(kwargs, dict):
                raise ConfigError(f"environments.{source} = {entry!r}: give an environment name "
                                  "or {environment = \"name\", env_kwargs = {...}}")
            routes[source] = (name, kwargs)
        return routes

    @property
    def overlaps(self) -> bool:
        """Whether generation runs ahead of the update (modes async, async+replay)."""
        return self.mode in ("async", "async+replay")

    @property
    def update_lr(self) -> float:
        """The update's learning rate (before any rollback lowers it): ``lr``, times
        ``off_policy_lr_factor`` in the modes that train on stale samples and times
        ``agent_lr_factor`` when agents play the episodes."""
        return (self.lr * (1.0 if self.mode == "sync" else self.off_policy_lr_factor)
                * (self.agent_lr_factor if self.agent else 1.0))

    @property
    def replays(self) -> bool:
        """Whether batches reuse groups from a replay buffer (modes replay, async+replay)."""
        return self.mode in ("replay", "async+replay")

    @property
    def replay_age(self) -> int:
        """``replay_max_age``, or with 0 the least that replays anything in this mode."""
        return self.replay_max_age or (2 * self.max_staleness + 1 if self.overlaps else 2)

    def scaling_knobs(self) -> ScalingKnobs:
        """The elastic policy's knobs of this run (the simulator takes the same)."""
        return ScalingKnobs(**{f.name: getattr(self, f.name)
                               for f in dataclasses.fields(ScalingKnobs)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_weight_url(url: str) -> None:
    """``ConfigError`` (one line) unless fsspec has a file system of ``url``'s protocol that
    other processes see too, with its package installed (s3fs for s3://, gcsfs for gcs://)."""
    protocol = split_protocol(url)[0]
    if protocol not in available_protocols():
        raise ConfigError(f"weight_store = {url!r}: fsspec knows no protocol {protocol!r}; "
                          "use 'run', 'cluster' or a URL of one of "
                          "fsspec.available_protocols() (s3, gcs, abfs, ftp, sftp, file, ...)")
    if protocol == "memory":
        raise ConfigError(f"weight_store = {url!r}: fsspec's memory file system lives in one "
                          "process, and the trainer and each generation worker are processes "
                          "of their own; use a store they all reach (s3://, gcs://, ftp://)")
    try:
        get_filesystem_class(protocol)
    except ImportError as err:
        raise ConfigError(f"weight_store = {url!r}: {err} (on the trainer's and the "
                          "generation workers' machines)") from None


def dataset_task(dataset: str) -> str:
    """The reasoning-gym task of ``dataset = "reasoning-gym:<task>"`` ("" for a file)."""
    adapter = adapter_of(dataset, DATASET_ADAPTERS)
    return adapter[1] if adapter else ""


def check_env_prompts(cfg: Config) -> None:
    """``env_prompts``: the environment's first observations are the prompt sets, so no
    ``dataset``, ``heldout``, per-source ``environments`` or agent goes with it."""
    if cfg.env_prompts < 0:
        raise ConfigError(f"env_prompts = {cfg.env_prompts} must be >= 0 (0: prompts from "
                          "dataset)")
    if not cfg.env_prompts:
        return
    given = [key for key in ("dataset", "heldout", "environments", "agent")
             if getattr(cfg, key)]
    if given:
        raise ConfigError(f"env_prompts = {cfg.env_prompts} draws the prompts from "
                          f"environment's reset: remove {' and '.join(given)}, or env_prompts")
    if not cfg.environment:
        raise ConfigError(f"env_prompts = {cfg.env_prompts} needs environment = '<library>:"
                          "<id>' or 'module:Class', a game that makes its first observation")
    if cfg.env_prompts < cfg.batch_prompts:  # a batch never repeats a prompt
        raise ConfigError(f"env_prompts = {cfg.env_prompts} is fewer than batch_prompts = "
                          f"{cfg.batch_prompts}: draw at least a batch of games")
    if cfg.env_prompts > HELDOUT_SEED:
        raise ConfigError(f"env_prompts = {cfg.env_prompts} must be at most {HELDOUT_SEED}: "
                          "the held-out games are seeded from there on")


def cuda_available() -> bool:
    import torch  # only when colocate asks: the config is read where torch is not needed

    return torch.cuda.is_available()


def check_mode(cfg: Config) -> None:
    """The knobs of the async and replay modes (pipeline/train/modes.py)."""
    if cfg.max_staleness < 0 or cfg.overlaps and cfg.max_staleness < 1:
        raise ConfigError(f"max_staleness = {cfg.max_staleness} must be >= 1 with mode = "
                          f"{cfg.mode!r} (0 is no overlap: mode = 'sync' or 'replay')")
    youngest = 2 * cfg.max_staleness + 1  # see pipeline/train/modes.py, async+replay
    if cfg.overlaps and cfg.replays and cfg.replay_age < youngest:
        raise ConfigError(
            f"replay_max_age = {cfg.replay_max_age} must be >= 2 * max_staleness + 1 = "
            f"{youngest} with mode = 'async+replay': the youngest group in the buffer is that "
            "many versions older than the batches it can join, so none would ever be replayed")
    if not cfg.tis_cap >= 1:
        raise ConfigError(f"tis_cap = {cfg.tis_cap} must be >= 1 (an on-policy token weighs 1)")
    for key in ("replay_age_decay", "replay_max_grad_share"):
        if not 0 < getattr(cfg, key) <= 1:
            raise ConfigError(f"{key} = {getattr(cfg, key)} must be in (0, 1]")
    if not 0 <= cfg.replay_ratio < 1:
        raise ConfigError(f"replay_ratio = {cfg.replay_ratio} must be in [0, 1): every batch "
                          "generates at least one prompt")
    if cfg.replay_longest and cfg.mode != "replay":
        raise ConfigError(f"replay_longest = true needs mode = 'replay', not {cfg.mode!r}: only "
                          "there do replayed groups replace fresh prompts")
    if cfg.replay_max_age < 0:
        raise ConfigError(f"replay_max_age = {cfg.replay_max_age} must be >= 0 (0: the least "
                          "that replays in this mode)")
    for key in ("replay_size", "keep_weights", "replay_max_skips"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key} = {getattr(cfg, key)} must be >= 1")
    if cfg.max_wall_s < 0:
        raise ConfigError(f"max_wall_s = {cfg.max_wall_s} must be >= 0 (0: no limit)")


def memory_bytes(memory: str) -> int:
    """Bytes of ``worker_memory`` as Dask reads it (``parse_bytes``); ``ConfigError`` unless
    it is a size of at least ``MIN_WORKER_MEMORY``."""
    allowed = (f"use a size of at least {MIN_WORKER_MEMORY >> 20} MiB per worker, such as "
               "'4GiB' or '2000MB'")
    try:
        size = parse_bytes(memory)
    except (ValueError, TypeError):
        raise ConfigError(f"worker_memory = {memory!r} is not a size: {allowed}") from None
    if size < MIN_WORKER_MEMORY:
        raise ConfigError(f"worker_memory = {memory!r} is {size} bytes, too little: {allowed} "
                          "(a worker holds ~250 MiB before any task)")
    return size


def walltime_seconds(walltime: str) -> int:
    """Seconds of a Slurm/PBS walltime: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", walltime.strip())
    if not m:
        raise ValueError(f"walltime = {walltime!r}: use HH:MM:SS, MM:SS, MM or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, mi, s = a, b or 0, c or 0
        return ((days * 24 + h) * 60 + mi) * 60 + s
    if c is not None:
        return (a * 60 + b) * 60 + c
    if b is not None:
        return a * 60 + b
    return a * 60


def _coerce(key: str, value: Any, kind: Any) -> Any:
    if kind is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} must be a finite number")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (str, int, float, bool):
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ConfigError(f"{key} = {value!r} must be of type {kind.__name__}")
        return value
    if getattr(kind, "__origin__", None) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} = {value!r} must be a list of strings")
        return list(value)
    if kind == dict[str, Any]:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} must be a table")
        return dict(value)
    want = float if "float" in str(kind) else str
    if not isinstance(value, dict) or not all(
        isinstance(v, want) or want is float and isinstance(v, int) for v in value.values()
    ) or want is float and not all(math.isfinite(v) for v in value.values()):
        raise ConfigError(f"{key} = {value!r} must be a table of {want.__name__} values")
    return {k: want(v) for k, v in value.items()}


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, raw = (s.strip() for s in item.split("=", 1))
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def make_config(values: dict[str, Any]) -> Config:
    """A ``Config`` from plain values; unknown keys and wrong types are ``ConfigError``s."""
    hints = get_type_hints(Config)
    known = {f.name for f in dataclasses.fields(Config)}
    checked = {}
    for key, value in values.items():
        key = RENAMED.get(key, key)
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ConfigError(f"unknown config key {key!r}; {hint}'rlhfless config' lists "
                              "every key with its default and meaning")
        checked[key] = _coerce(key, value, hints[key])
    return Config(**checked)


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                base: dict[str, Any] | None = None) -> Config:
    """Read ``path`` (TOML, optional) over ``base`` (plain values, e.g. a saved run's
    config.json) and apply ``key=value`` overrides on top."""
    values: dict[str, Any] = dict(base or {})
    if path is not None:
        try:
            values |= tomllib.loads(Path(path).read_text())
        except FileNotFoundError as err:
            raise ConfigError(f"config file {path} does not exist") from err
        except IsADirectoryError as err:
            raise ConfigError(f"config file {path} is a directory; give a TOML file") from err
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {path} is not UTF-8 text; give a TOML file") from err
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {path}: {err}") from err
    for item in overrides:
        key, value = _parse_override(item)
        values[key] = value
    return make_config(values)
