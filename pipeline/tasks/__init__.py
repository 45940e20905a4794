"""What runs on workers: rollout, scoring, trainer, tail, emulated tasks."""
