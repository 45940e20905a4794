"""The discrete-event simulator: engine, events, modes, workloads, bounds."""
