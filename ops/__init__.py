"""rlhfless.ops."""
