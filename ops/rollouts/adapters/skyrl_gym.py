"""skyrl-gym environments, unchanged: ``environment = "skyrl-gym:<id>"``.

skyrl-gym's ``BaseTextEnv`` is made per episode with ``skyrl_gym.make(id, env_config=...,
extras=row)``, as SkyRL makes it from a dataset row: ``env_config`` is the configuration's
``env_kwargs`` (an OmegaConf config, as SkyRL passes it), ``extras`` the whole row. A row
without ``reward_spec`` (a plain prompt/answer dataset) gets ``{"method": "rule",
"ground_truth": answer}``, and one without ``extra_info`` an empty one, which is what the
built-in environments (gsm8k, gsm8k_multi_turn, aime) read.

``init(prompt)`` gets the row's ``prompt`` when it is chat messages, else the prompt text as
one user message; messages it returns beyond that prompt are appended. ``step(turn)``'s
``observations`` (chat messages) are appended through the model's chat template, its
``reward`` is the turn's reward, its ``done`` ends the episode.
"""

from __future__ import annotations

from ..env import Environment, StepResult
from .library import import_library


class SkyrlGymEnv(Environment):
    def __init__(self, env_id: str, **env_kwargs) -> None:
        self.skyrl = import_library("skyrl_gym", "skyrl-gym")
        if env_id not in self.skyrl.registry:
            raise ValueError(f"skyrl-gym has no environment {env_id!r}; registered: "
                             f"{sorted(self.skyrl.registry)}")
        self.env_id, self.env_config, self.env = env_id, env_kwargs, None

    def reset(self, row: dict) -> list[dict] | None:
        from omegaconf import OmegaConf  # a dependency of skyrl-gym

        extras = dict(row)
        if extras.get("reward_spec") is None:
            extras["reward_spec"] = {"method": "rule", "ground_truth": row.get("answer")}
        if extras.get("extra_info") is None:
            extras["extra_info"] = {}
        self.env = self.skyrl.make(self.env_id, env_config=OmegaConf.create(self.env_config),
                                   extras=extras)
        prompt = row.get("prompt")
        if not (isinstance(prompt, list) and prompt):
            prompt = [{"role": "user", "content": row["prompt_text"]}]
        observations, _ = self.env.init(prompt)
        added = list(observations)[len(prompt):] if observations[:len(prompt)] == prompt else []
        return added or None

    def step(self, turn: str) -> StepResult:
        out = self.env.step(turn)
        return StepResult(list(out["observations"]), float(out["reward"]), bool(out["done"]))

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
