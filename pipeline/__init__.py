"""rlhfless.pipeline."""
