"""How an overlapping mode divides one machine's cores between generation and the trainer.

In sync mode generation and the update take turns: each may use every core of the machine.
In the async modes they run at once, so on one machine (a ``LocalCluster``) the generation
workers' threads and the trainer's threads share its cores, and threads beyond the cores are
time-sliced against each other: the overlap async exists for turns into contention. Measured
on 2 cores (docs/benchmarks.md#stability, seed 0, 20 iterations): the default pool, 2
generation workers of 1 thread and a trainer of 2 threads, made async 1.17x sync; 1 worker
and 1 trainer thread made it 1.45x.

The split is a cost model of the overlapped iteration. With ``g`` generation workers of
``gen_threads`` threads and ``t`` threads on each of the trainer's ``train_ranks``, an
iteration takes about ``max(G / g, U / t)``, where ``G`` and ``U`` are the seconds one worker
takes to generate a batch and one thread takes to update on it (work divides evenly over
workers and threads: ideal scaling). The split minimises it subject to ``g * gen_threads +
train_ranks * t <= cores``, ``1 <= g <= max_gen_workers``, ``1 <= t <= max_train_threads``;
of equal times it takes the one with more threads, then more generation workers.
``gen_share = G / (G + U)``; without a measurement of the run (before it starts) the prior is
0.5, generation and update alike, which on 2 cores leaves one split anyway.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PoolSplit:
    gen_workers: int
    train_threads: int
    cores: int
    reason: str

    def to_record(self) -> dict:
        return asdict(self)


def split_for_overlap(cores: int, gen_threads: int, max_gen_workers: int,
                      max_train_threads: int, train_ranks: int = 1,
                      gen_share: float = 0.5) -> PoolSplit:
    """The generation workers and threads per trainer rank of an overlapping mode on
    ``cores`` cores, each at most what was asked (``max_*``)."""
    for name, value in (("cores", cores), ("gen_threads", gen_threads),
                        ("max_gen_workers", max_gen_workers),
                        ("max_train_threads", max_train_threads), ("train_ranks", train_ranks)):
        if value < 1:
            raise ValueError(f"split_for_overlap: {name} = {value}; allowed: >= 1")
    if not 0 < gen_share < 1:
        raise ValueError(f"split_for_overlap: gen_share = {gen_share}; allowed: in (0, 1)")
    if max_gen_workers * gen_threads + train_ranks * max_train_threads <= cores:
        return PoolSplit(max_gen_workers, max_train_threads, cores, "as asked: it fits")
    fits = [(g, t) for g in range(1, max_gen_workers + 1)
            for t in range(1, max_train_threads + 1) if g * gen_threads + train_ranks * t <= cores]
    if not fits:
        return PoolSplit(1, 1, cores, "the smallest split: none fits the cores")

    def cost(split: tuple[int, int]) -> tuple[float, int, int]:
        g, t = split
        return max(gen_share / g, (1 - gen_share) / t), -(g * gen_threads + train_ranks * t), -g

    g, t = min(fits, key=cost)
    return PoolSplit(g, t, cores, "fits the cores: generation and update overlap")
