"""Experience replay: the buffer of recent groups and its diagnostics."""
