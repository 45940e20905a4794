"""rlhfless.schedulers: when, where and on how many workers each stage runs, and what it costs.

Pure policies (state in, decision out; numpy and the standard library only), so the live Dask
wiring and the simulator call the same code:

- ``predictor``: per-prompt EWMA of response lengths, with a fallback for unseen prompts;
- ``throughput``: per-worker generation time (decode step time vs batch, prefill rate, cold
  start), fitted online from the run's own timings;
- ``assignment``: prompt groups to workers, length-grouped (or round-robin for comparison);
- ``scaling``: the number of generation workers minimising weighted time and worker-seconds;
- ``migration``: cut-and-migrate of the workers' tails (few sequences left), planned jointly;
- ``ledger``: worker lifetimes priced per worker-second and attributed to iterations.

Decisions are frozen dataclasses with ``to_record()`` for the run directory's logs.
"""
