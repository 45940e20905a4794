"""What a run is built from: its model, its prompt sets, and the specs its tasks get.

``resolve_model`` finds the model directory (building the embedded tiny one on first use),
``load_prompt_sets`` reads the training and held-out prompts with one-line errors (a
``dataset`` without ``heldout`` keeps a fixed split of itself out of training to evaluate on), and
``make_specs`` turns the configuration into the frozen ``Specs`` that generation, reward and
update tasks carry to the workers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pa_compute
from transformers import AutoTokenizer

from rlhfless.ops.algo.update import UpdateParams
from rlhfless.ops.data.load import LoadResult, read_prompts
from rlhfless.ops.engine.engine_types import EngineSpec, RemoteStore, SamplingParams
from rlhfless.ops.engine.lora import LoraSpec
from rlhfless.ops.engine.registry import resolved
from rlhfless.ops.rollouts.adapters import reasoning_gym
from rlhfless.ops.rollouts.agent import AgentParams
from rlhfless.ops.rollouts.env import BUILTIN_AGENTS
from rlhfless.ops.rollouts.env_prompts import HELDOUT_SEED, env_prompt_records
from rlhfless.ops.rollouts.episode import EpisodeParams
from rlhfless.ops.rollouts.resolve import resolve_environment
from rlhfless.ops.rollouts.reward import describe_error
from rlhfless.ops.toy.tinymodel import TASK_RECIPES, ensure_tiny_model, with_context
from rlhfless.ops.toy.tinytask import LongTailTallyTask, make_splits

from .config import Config, ConfigError, dataset_task
from .durable.runs import RunDir
from .tasks.rollout import GenSpec
from .tasks.scoring import RewardSpec
from .tasks.trainer import TrainSpec

# a dataset without heldout: 1 in HELDOUT_SHARE of its prompts (1 at least, heldout_prompts at
# most) is held out for evaluation, chosen by a keyed hash of the prompt_id (split_heldout)
HELDOUT_SHARE = 10
HELDOUT_SALT = b"rlhfless heldout"


@dataclass(frozen=True)
class Specs:
    gen: GenSpec
    eval: GenSpec
    reward: RewardSpec
    train: TrainSpec


def resolve_model(cfg: Config, log=print) -> Path:
    """The model directory: the tiny one built (``tiny_context``: with that context), or
    ``model`` as it is."""
    if cfg.model == "tiny":
        path = ensure_tiny_model(recipe=TASK_RECIPES[cfg.task], log=log)
    else:
        path = Path(cfg.model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model = {cfg.model!r}: no Hugging Face config.json there")
    return with_context(path, cfg.tiny_context) if cfg.tiny_context else path


def make_specs(cfg: Config, model_path: Path, run: RunDir) -> Specs:
    sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    lora = (LoraSpec(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_target_modules))
            if cfg.lora_rank else None)
    gen_engine = EngineSpec(str(model_path), cfg.device, cfg.gen_threads, cfg.backend,
                            cfg.colocate, lora, cfg.gen_dtype, cfg.gpu_memory_utilization)
    gen_engine = resolved(gen_engine)  # workers build the class the driver named
    update = UpdateParams(lr=cfg.update_lr, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                          temperature=cfg.temperature, top_p=cfg.top_p,
                          micro_batch_tokens=cfg.micro_batch_tokens,
                          max_grad_norm=cfg.max_grad_norm, epochs=cfg.epochs)
    episodes, agent = episode_params(cfg), agent_params(cfg)
    return Specs(
        gen=GenSpec(gen_engine, cfg.n_samples, sampling, cfg.share_prefixes,
                    episodes=episodes, agent=agent),
        eval=GenSpec(gen_engine, 1, SamplingParams(cfg.max_new_tokens, greedy=True),
                     cfg.share_prefixes, episodes=episodes, agent=agent),
        reward=RewardSpec(run_rewards(cfg), cfg.default_reward, cfg.reward_timeout_s,
                          cfg.reward_fallback),
        train=TrainSpec(EngineSpec(str(model_path), cfg.device, cfg.train_threads, lora=lora),
                        update, weight_store(cfg, run.weights),
                        world=cfg.train_workers,
                        parallel=cfg.train_parallel, bf16=cfg.train_dtype == "bfloat16",
                        gradient_checkpointing=cfg.gradient_checkpointing),
    )


def weight_store(cfg: Config, run_weights: Path) -> str | RemoteStore | None:
    """Where the trainer publishes: the run's ``weights/`` directory, an fsspec URL store
    with its storage options, or None (held by the trainer for the cluster)."""
    if cfg.weight_store == "run":
        return str(run_weights)
    if cfg.weight_store == "cluster":
        return None
    return RemoteStore(cfg.weight_store, tuple(sorted(cfg.weight_store_options.items())),
                       cfg.keep_weights)


def run_rewards(cfg: Config) -> dict[str, str]:
    """``rewards``, with a ``"reasoning-gym:<task>"`` dataset's own scorer for its rows
    (their ``data_source`` is the same name) unless ``rewards`` routes them elsewhere."""
    rewards = dict(cfg.rewards)
    if dataset_task(cfg.dataset):
        source = f"reasoning-gym:{dataset_task(cfg.dataset)}"
        rewards.setdefault(source, source)
    return rewards


def dataset_source(cfg: Config, model_path: Path) -> str | Path | pa.Table:
    """What ``read_prompts`` reads for ``dataset``: the file, the rows drawn from a
    reasoning-gym task (``dataset_kwargs``: size, seed and its config), or the tiny task's."""
    task = dataset_task(cfg.dataset)
    if task:
        try:
            reasoning_gym.check_task(task)
            return pa.Table.from_pylist(reasoning_gym.task_records(task, **cfg.dataset_kwargs))
        except (ValueError, TypeError, AssertionError) as err:  # no package, task, config key
            raise ConfigError(f"dataset = {cfg.dataset!r}: {' '.join(str(err).split())}"
                              ) from None
    return cfg.dataset or task_prompts(cfg, model_path, "train")


def episode_params(cfg: Config) -> EpisodeParams | None:
    """Multi-turn rollouts' settings, or None for single-turn generation."""
    if not cfg.multi_turn:
        return None
    return EpisodeParams(cfg.episode_environment, dict(cfg.env_kwargs), cfg.max_turns,
                         cfg.max_turn_tokens, cfg.max_episode_tokens, cfg.env_step_timeout_s,
                         step_cut_turns=cfg.step_cut_turns, routes=cfg.environment_routes())


def agent_params(cfg: Config) -> AgentParams | None:
    """Agent episodes' settings, or None; ``agent_chat_template`` is read here, so a file
    that cannot be read is a ``ConfigError`` before anything starts; ``agent_ca_file``'s
    text travels to the workers."""
    if not cfg.agent:
        return None
    template = None
    if cfg.agent_chat_template:
        try:
            template = Path(cfg.agent_chat_template).read_text()
        except OSError as err:
            raise ConfigError(f"agent_chat_template = {cfg.agent_chat_template!r} cannot be "
                              f"read: {err.strerror}") from None
    return AgentParams(BUILTIN_AGENTS.get(cfg.agent, cfg.agent), cfg.agent_timeout_s,
                       cfg.agent_concurrency, template, cfg.agent_host, cfg.agent_service_ca(),
                       cfg.agent_processes)


def load_prompt_sets(cfg: Config, model_path: Path,
                     log: Callable[[str], None] = print) -> tuple[pa.Table, pa.Table, dict]:
    """The training and held-out prompts, and what loading skipped (counted, and said once
    through ``log``). A ``dataset`` without ``heldout`` keeps its own held-out split
    (``split_heldout``, said through ``log``), never the tiny task's. A source that cannot be
    read, a bad row (under ``on_bad_row = "error"``), a duplicate id, fewer training prompts
    than a batch or no held-out prompt is a ``ConfigError`` of one line. ``prompt_key`` and
    ``answer_key`` name the columns of your files (``dataset``, ``heldout``), not of the tiny
    task's or a reasoning-gym task's rows."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    kw = dict(max_prompt_tokens=cfg.max_prompt_tokens, on_bad_row=cfg.on_bad_row,
              on_long_prompt=cfg.on_long_prompt,  # a game's prompts have no answer: it scores
              require_answers=cfg.require_answers and not cfg.env_prompts)
    yours = kw | dict(prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)  # your files' columns
    own_file = cfg.dataset and not dataset_task(cfg.dataset)
    train = _read_prompt_set("dataset", dataset_source(cfg, model_path), tokenizer,
                             yours if own_file else kw)
    source = f"dataset {cfg.dataset or _own_prompts(cfg)}"
    if len(train.table) == 0:
        raise ConfigError(f"{source}: no prompts{_skipped(train)}; give at least "
                          f"batch_prompts = {cfg.batch_prompts}")
    prompts, held = train.table, ""
    if cfg.dataset and not cfg.heldout:
        n_held = min(cfg.heldout_prompts, max(1, len(prompts) // HELDOUT_SHARE))
        prompts, heldout_table = split_heldout(prompts, n_held)
        held = f" ({n_held} more held out for evaluation: heldout is not given)"
    else:
        heldout = _read_prompt_set(
            "heldout", cfg.heldout or task_prompts(cfg, model_path, "heldout"), tokenizer,
            yours if cfg.heldout else kw)
        heldout_source = f"heldout {cfg.heldout or _own_prompts(cfg)}"
        if len(heldout.table) == 0:  # its accuracy would be NaN
            raise ConfigError(f"{heldout_source}: no prompts{_skipped(heldout)}; held-out "
                              "accuracy needs at least one")
        heldout_table = heldout.table
    n = len(prompts)
    if n < cfg.batch_prompts:  # a batch never repeats a prompt
        raise ConfigError(f"{source}: {n} prompts{_skipped(train)}{held}, fewer than "
                          f"batch_prompts = {cfg.batch_prompts}; set batch_prompts to at most "
                          f"{n} or give more{' (or give heldout)' if held else ''}")
    _say_skipped(log, source, train)
    if cfg.env_prompts:
        log(f"prompts: {n} first observations of {cfg.environment} (seeds 0-"
            f"{cfg.env_prompts - 1}, env_prompts); heldout: {len(heldout_table)} more "
            f"(seeds from {HELDOUT_SEED})")
    if held:
        log(f"heldout: {len(heldout_table)} of the {len(train.table)} prompts of {source}, "
            "kept out of training (a fixed split by prompt_id); set heldout to evaluate on "
            "prompts of your own")
    else:
        _say_skipped(log, heldout_source, heldout)
    counts = {"prompts_skipped_bad": train.n_skipped_bad, "prompts_truncated": train.n_truncated,
              "prompts_skipped_long": train.n_skipped_long}
    return prompts, heldout_table.slice(0, cfg.heldout_prompts), counts


def split_heldout(table: pa.Table, n: int) -> tuple[pa.Table, pa.Table]:
    """(training, held-out) rows of a ``PROMPTS`` table: the ``n`` whose ``prompt_id`` hashes
    lowest (BLAKE2b keyed with ``HELDOUT_SALT``) are held out; both keep the source order. The
    split depends on the ids alone: not on row order, ``seed`` or a resume."""
    ids = table.column("prompt_id").to_pylist()
    rank = sorted(range(len(ids)), key=lambda i: hashlib.blake2b(
        ids[i].encode(), key=HELDOUT_SALT, digest_size=8).digest())
    held = set(rank[:n])
    mask = pa.array([i in held for i in range(len(ids))], pa.bool_())
    return table.filter(pa_compute.invert(mask)), table.filter(mask)


def task_prompts(cfg: Config, model_path: Path, split: str) -> Path | pa.Table:
    """The ``split`` ("train" or "heldout") prompts when no file is given: with
    ``env_prompts`` the environment's first observations (training seeds ``0..N-1``,
    held-out ``heldout_prompts`` seeds from ``HELDOUT_SEED``; ``env_prompts.py``), else the
    embedded task's: the model directory's file, or with ``task = "tally-long"`` the
    long-tail setting's (``LongTailTallyTask``, drawn with the model recipe's seed, in
    memory)."""
    if cfg.env_prompts:
        first = 0 if split == "train" else HELDOUT_SEED
        return env_prompt_table(cfg, range(first, first + (
            cfg.env_prompts if split == "train" else cfg.heldout_prompts)))
    if cfg.model == "tiny" and cfg.task == "tally-long":
        task = LongTailTallyTask(n_sft=0)
        return pa.Table.from_pylist(make_splits(task, TASK_RECIPES[cfg.task].seed)[split])
    return model_path / f"{split}.jsonl"


def env_prompt_table(cfg: Config, seeds: range) -> pa.Table:
    """The prompt records of ``environment``'s first observations for ``seeds``; what the
    environment raises is a one-line ``ConfigError``."""
    try:
        return pa.Table.from_pylist(env_prompt_records(
            resolve_environment(cfg.environment), cfg.env_kwargs, cfg.environment, seeds))
    except Exception as err:  # the environment's own code may raise anything
        raise ConfigError(f"env_prompts: environment = {cfg.environment!r}: "
                          f"{describe_error(err)}") from None


def _own_prompts(cfg: Config) -> str:
    """What a prompt set without a file is drawn from, for messages."""
    return (f"drawn from {cfg.environment} (env_prompts)" if cfg.env_prompts
            else "of the tiny task")


def _read_prompt_set(key: str, source: str | Path, tokenizer, kw: dict) -> LoadResult:
    """``read_prompts``; what it raises (naming file and row) as a one-line ``ConfigError``."""
    try:
        return read_prompts(source, tokenizer, **kw)
    except (ValueError, OSError, TypeError) as err:
        message = f"{key}: {err}".replace("pass on_bad_row='skip'", "set on_bad_row = 'skip'")
        raise ConfigError(" ".join(message.split())) from None


def _skipped(result: LoadResult) -> str:
    """`` (of N rows read: k bad skipped, m over max_prompt_tokens skipped, t truncated to
    max_prompt_tokens)`` when loading dropped or cut rows, else nothing."""
    dropped = [f"{n} {why}" for n, why in (
        (result.n_skipped_bad, "bad skipped"),
        (result.n_skipped_long, "over max_prompt_tokens skipped"),
        (result.n_truncated, "truncated to max_prompt_tokens")) if n]
    return f" (of {result.n_rows_read} rows read: {', '.join(dropped)})" if dropped else ""


def _say_skipped(log: Callable[[str], None], source: str, result: LoadResult) -> None:
    """One line, once, for what loading ``source`` skipped or truncated, with the first
    reason."""
    if _skipped(result):
        first = f"; first: {result.skipped[0]}" if result.skipped else ""
        log(f"{source}: {len(result.table)} prompts{_skipped(result)}{first}")
