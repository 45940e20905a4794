"""The simulator's front end: ``rlhfless simulate`` and its report."""
