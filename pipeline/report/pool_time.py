"""Where each pool's worker-seconds went in an iteration: busy, waiting, idle; and its bound.

Per worker, over the part of the iteration window ``[t0, t1]`` it was billed for (the
ledger's lifetime, so the three add up to the ledger's ``<pool>_worker_s`` exactly):

- **busy**: the union of its tasks' compute spans (Dask's task stream ``startstops``);
- **waiting**: the union of its tasks' other spans (transfers of inputs, disk reads) outside
  busy, plus, on the generation pool, the seconds its engines decoded nothing because they
  waited on environments or agents (``env_wait_seconds``, moved from busy);
- **idle**: the rest: billed, and running nothing.

Each comes as seconds per pool (``gen_busy_s``) and as a share of the pool's worker-seconds
(``gen_busy_share``). The **bound** says which work held the iteration: of the generation
pool's active wall (seconds in which any of its workers computed) and the trainer's, the
longer; "agent-bound" where generation is the longer and its engines waited on
environments or agents (``gen_agent_wait_s``) longer than they computed. A task still running
when the iteration is accounted (a batch generated ahead, async) is counted in the
iteration it ends in, clipped to that iteration's window.

Pure: records in, figures out; the loop feeds it (``bookkeeping.account``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

Span = tuple[float, float]


def merged(spans: Iterable[Span]) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint spans (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measure(spans: Iterable[Span]) -> float:
    """Seconds covered by the union of ``spans``."""
    return sum(b - a for a, b in merged(spans))


def clipped(spans: Iterable[Span], lo: float, hi: float) -> list[Span]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def minus(spans: list[Span], taken: list[Span]) -> float:
    """Seconds of the union of ``spans`` outside the union of ``taken``."""
    union, cut = merged(spans), merged(taken)
    return measure(union) - sum(measure(clipped(cut, a, b)) for a, b in union)


def task_spans(tasks: Iterable[dict]) -> dict[str, dict[str, list[Span]]]:
    """``{worker name: {"compute": spans, "other": spans}}`` from task-stream records
    (``plugin.task_records``: each with ``worker_name`` and ``startstops``)."""
    out: dict[str, dict[str, list[Span]]] = defaultdict(lambda: {"compute": [], "other": []})
    for task in tasks:
        for ss in task["startstops"]:
            kind = "compute" if ss["action"] == "compute" else "other"
            out[task["worker_name"]][kind].append((ss["start"], ss["stop"]))
    return out


def pool_time(tasks: list[dict], lives: list[dict], t0: float, t1: float,
              env_wait_s: float = 0.0) -> dict:
    """Busy, waiting and idle seconds and shares per pool in ``[t0, t1]``, and the bound.
    ``lives``: the ledger's worker rows (``CostLedger.records(until=t1)``, kind "worker":
    name, pool, t_start, t_end); ``env_wait_s``: the generation engines' seconds waiting on
    environments or agents in the iteration."""
    spans = task_spans(tasks)
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(
        ("worker", "busy", "waiting"), 0.0))
    active: dict[str, list[Span]] = defaultdict(list)
    for life in lives:
        if life["kind"] != "worker":
            continue
        lo = max(t0, life["t_start"])
        hi = min(t1, life["t_end"] if life["t_end"] is not None else t1)
        pool = seconds[life["pool"]]
        if hi <= lo:
            continue
        mine = spans.get(life["name"], {"compute": [], "other": []})
        compute = clipped(mine["compute"], lo, hi)
        pool["worker"] += hi - lo
        pool["busy"] += measure(compute)
        pool["waiting"] += minus(clipped(mine["other"], lo, hi), compute)
        active[life["pool"]] += compute
    if "gen" in seconds:  # engines waiting on environments: waiting, not busy
        moved = min(env_wait_s, seconds["gen"]["busy"])
        seconds["gen"]["busy"] -= moved
        seconds["gen"]["waiting"] += moved
    out: dict = {"gen_agent_wait_s": moved} if "gen" in seconds else {}
    for name, pool in sorted(seconds.items()):
        idle = pool["worker"] - pool["busy"] - pool["waiting"]
        out |= {f"{name}_busy_s": pool["busy"], f"{name}_waiting_s": pool["waiting"],
                f"{name}_idle_s": idle, f"{name}_active_s": measure(active[name])}
        for part, value in (("busy", pool["busy"]), ("waiting", pool["waiting"]),
                            ("idle", idle)):
            out[f"{name}_{part}_share"] = value / pool["worker"] if pool["worker"] > 0 else None
    out["bound"] = bound(out)
    return out


def bound(figures: dict) -> str | None:
    """"generation-bound", "update-bound" or "agent-bound" (module docstring) from
    ``pool_time``'s figures; None where neither pool computed."""
    gen, train = figures.get("gen_active_s", 0.0), figures.get("train_active_s", 0.0)
    if gen <= 0 and train <= 0:
        return None
    if train >= gen:
        return "update-bound"
    waited = figures.get("gen_agent_wait_s", 0.0)
    return "agent-bound" if waited > figures.get("gen_busy_s", 0.0) else "generation-bound"
