"""What a run is built from, in one place: ``build_run`` gives the loop its prompts, task
specs, prompt order, first weights, ledger, scaling policy and deployment.

Every engine gets the same parts (``specs.py``: the model, the prompt sets, the specs),
except the emulated one (``backend = "emulated"``), whose parts come from a workload trace
and a GPU profile (``emulation.py``): the one place the loop learns that a run is
emulated; from here on it runs the same driver.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlhfless.ops.engine.backend import resolve_device, resolve_dtype
from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.lora import LoraSpec
from rlhfless.ops.engine.model_size import model_params
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.scaling_policy import ScalingPolicy
from rlhfless.schedulers.weight_costs import WeightCosts

from ..cluster.deploy import Deployment, deployment_from_config
from ..config import Config, ConfigError
from ..durable.runs import RunDir
from ..durable.sampler import PromptSampler
from ..specs import Specs, load_prompt_sets, make_specs, resolve_model
from ..tasks.scoring import RewardSpec
from .emulation import Emulation
from .inputs import check_routes, fit_context
from .modes import mode_specs


@dataclass
class RunParts:
    model_path: str
    prompts: pa.Table  # the training prompts (their digest guards a resume)
    heldout: pa.Table
    specs: Specs
    sampler: Any  # PromptSampler, or an emulated run's TraceSampler
    weights: WeightsRef  # version 0
    ledger: CostLedger
    scaling: ScalingPolicy
    deployment: Deployment
    rest_workers: float | None = None  # the elastic policy's: None, the trainer's workers


def build_run(cfg: Config, run: RunDir, log) -> RunParts:
    if cfg.backend == "emulated":
        return _emulated(cfg, run, log)
    model_path = resolve_model(cfg, log=log)
    prompts, heldout, counts = load_prompt_sets(cfg, model_path, log=log)
    model_path = fit_context(cfg, model_path, {"dataset": prompts, "heldout": heldout}, log)
    check_routes(cfg, {"dataset": prompts, "heldout": heldout})
    run.append_metrics({"event": "data", "prompts": len(prompts), "heldout": len(heldout),
                        **counts})
    specs = mode_specs(make_specs(cfg, model_path, run), cfg)
    return RunParts(str(model_path), prompts, heldout, specs,
                    PromptSampler(prompts, cfg.batch_prompts, cfg.seed),
                    WeightsRef(0, str(model_path)), CostLedger(cfg.prices),
                    scaling_policy(cfg, model_path, specs.gen.engine.lora),
                    deployment_from_config(cfg, run.path))


def scaling_policy(cfg: Config, model_path: str | Path,
                   lora: LoraSpec | None) -> ScalingPolicy:
    """The run's elastic policy, its cold start and per-version fetch priced at the model's
    size (``WeightCosts``): its parameters at the generation engine's dtype, a LoRA run's
    adapter alone per version, over the configured rates."""
    params, adapter = model_params(model_path, lora)
    dtype = resolve_dtype(cfg.gen_dtype, resolve_device(cfg.device))
    costs = WeightCosts.of_model(params, dtype.itemsize, cfg.weight_load_gbs,
                                 cfg.weight_fetch_gbs, cfg.engine_start_s, adapter)
    return ScalingPolicy(cfg.scaling_knobs(), costs.throughput())


def _emulated(cfg: Config, run: RunDir, log) -> RunParts:
    if cfg.cluster != "local":
        raise ConfigError(f"backend = 'emulated' runs its pools on this machine; cluster = "
                          f"{cfg.cluster!r} is not allowed with it (use 'local')")
    emulation = Emulation.of(cfg)
    weights = emulation.weights()
    specs = make_specs(cfg, Path(weights.path), run)
    engine = dataclasses.replace(specs.gen.engine, options=emulation.engine_options)
    specs = dataclasses.replace(
        specs, gen=dataclasses.replace(specs.gen, engine=engine),
        eval=dataclasses.replace(specs.eval, engine=engine),
        reward=RewardSpec({"emulated": "exact"}, "exact", cfg.reward_timeout_s,
                          cfg.reward_fallback),
        train=dataclasses.replace(specs.train, emulate=emulation.learner))
    sampler, heldout = emulation.sampler(), emulation.heldout()
    log(f"emulated: {cfg.emulate_workload} trace of {cfg.iterations} batches on "
        f"{emulation.profile.name}, {cfg.emulate_train_gpus} learner GPUs, "
        f"{cfg.emulate_time_scale:g} wall s per emulated s")
    run.append_metrics({"event": "data", "prompts": len(sampler.prompts),
                        "heldout": len(heldout), "emulated_workload": cfg.emulate_workload,
                        "emulate_profile": emulation.profile.name,
                        "emulate_time_scale": cfg.emulate_time_scale})
    base = deployment_from_config(cfg, run.path)
    deployment = emulation.deployment(base)
    return RunParts(weights.path, sampler.prompts, heldout, mode_specs(specs, cfg), sampler,
                    weights, emulation.ledger(), emulation.scaling(), deployment,
                    emulation.rest_workers)
