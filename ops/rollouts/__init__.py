"""Rollouts beyond one generation: rewards, episodes, environments, tools."""
