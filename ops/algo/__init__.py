"""The RL algorithm: advantages, off-policy correction, the update, ranks."""
