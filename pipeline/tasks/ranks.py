"""The trainer pool as ranks of one ``torch.distributed`` process group, on Dask workers.

With ``train_workers = N > 1`` every worker of the TRAIN pool is one rank. The driver forms
the group (``form_group``) when a run starts and again whenever it recovers:

    leave_task         on every trainer worker (``trainer.leave_trainer_task``): drop its
                       trainer and its old group (``leave_group``), if any
    join_group_task    on every member at once: init_process_group (gloo on CPU, NCCL on
                       CUDA) through the group's rendezvous store; rank = the member's place
                       in the list

The rendezvous store is a ``torch.distributed.FileStore``: a new file of the run's private
``ranks/`` directory (0700, made by ``store_dir``) for each group, so nothing listens for it
and only the run's Unix user can read or set its keys (a ``TCPStore`` would listen on every
interface and answer anyone). The ranks must share that file system: the run directory, as
they share it for checkpoints (batch jobs: the shared file system their TLS files are on).
The collectives' own sockets (gloo's pairs, NCCL's bootstrap) bind to the interface of the
member's Dask address (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless set): loopback
for a local cluster, the configured ``interface`` for batch jobs.

Tasks of one update or publish reach every rank through ``on_ranks``: one task per member,
pinned to its address, the calling rank's own part run in place. Graph tasks that need the
trainer (``update``, ``publish``, resource ``TRAIN``) land on any member and fan out from
there, so the iteration graph, the elastic driver and the async modes are the same for one
rank and for N. A member that died is restarted by its nanny as a new process without a
group: the next collective fails on the others, ``Durable`` sees a trainer token missing,
forms a new group over the pool and restores the last checkpoint on every rank.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import torch
import torch.distributed as dist
from distributed import Client, get_client, get_worker, wait

from rlhfless.ops.algo.parallel import Ranks

COLLECTIVE_TIMEOUT_S = 120.0  # a collective waiting longer on a peer fails (a lost rank)
_GROUP: dict[str, Any] = {}  # this process: "ranks", "members", "store"
STORE_PREFIX = "store-"  # a group's FileStore in the run's ranks/ directory


def store_dir(run_path: str | Path) -> Path:
    """The run's directory of rendezvous stores, 0700 whatever the run's umask."""
    path = Path(run_path) / "ranks"
    path.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)
    return path


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds ``host``'s address, if one does."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return None
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == address:
                        return name
                except ValueError:
                    continue
    return None


def _bind_collectives() -> None:
    """Have gloo and NCCL listen on the interface of this worker's Dask address."""
    host = urlparse(get_worker().address).hostname
    name = interface_of(host) if host else None
    if name is not None:
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(key, name)


def backend_for(device: str) -> str:
    """gloo on CPU, NCCL on CUDA."""
    if device == "cuda" or device == "auto" and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def join_group_task(store_path: str, rank: int, members: list[str], backend: str,
                    parallel: str) -> int:
    """Join the group as ``rank`` of ``len(members)`` through the FileStore at
    ``store_path``."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.FileStore(store_path, len(members))
    store.set_timeout(timeout)
    _bind_collectives()
    if backend == "nccl":
        # one GPU per rank: a job's own visible device, or the rank's on a shared node
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=len(members),
                            timeout=timeout)
    _GROUP.update(ranks=Ranks(rank, len(members), parallel), members=list(members),
                  store=store)
    return rank


def leave_group() -> bool:
    """Leave this process's group, if any; True if it had one."""
    had = dist.is_initialized()
    if had:
        dist.destroy_process_group()
    _GROUP.clear()
    return had


def this_rank() -> Ranks:
    """This process's rank; RuntimeError if it is in no group (e.g. restarted)."""
    if "ranks" not in _GROUP or not dist.is_initialized():
        raise RuntimeError("this trainer worker is in no process group (it restarted?); the "
                           "run must form the group again")
    return _GROUP["ranks"]


def on_ranks(fn: Callable, *args, client: Client | None = None,
             members: list[str] | None = None) -> list:
    """``fn(*args)`` on every member, concurrently; results in rank order. Called in a member
    (``members`` default to its group's, its own part runs here) or by the driver."""
    inside = members is None
    if inside:
        members, own = _GROUP["members"], this_rank().rank
        client = get_client()
    else:
        own = None
    tag = uuid.uuid4().hex[:12]
    futures = [client.submit(fn, *args, workers=[address], allow_other_workers=False,
                             pure=False, key=f"{fn.__name__}-rank-{r}-{tag}")
               for r, address in enumerate(members) if r != own]
    own_result = [] if own is None else [fn(*args)]
    others = gather_members(client, futures, [a for r, a in enumerate(members) if r != own])
    return others if own is None else others[:own] + own_result + others[own:]


def gather_members(client: Client, futures: list, addresses: list[str]) -> list:
    """Results of ``futures``, each pinned to the worker at the same place of ``addresses``;
    RuntimeError as soon as one of those workers is gone (its task would wait forever)."""
    while True:
        try:
            wait(futures, timeout=1.0)
            return client.gather(futures)
        except TimeoutError:
            pass
        connected = set(client.scheduler_info(n_workers=-1)["workers"])
        gone = [a for a in addresses if a not in connected]
        if gone:
            raise RuntimeError(f"trainer ranks at {gone} are gone; the process group is "
                               "broken")


def form_group(client: Client, members: list[str], leavers: list[str], device: str,
               parallel: str, leave_task: Callable[[], bool], stores: Path) -> list[str]:
    """A new process group over ``members`` (worker addresses, rank order) after every
    worker in ``leavers`` (members included) ran ``leave_task`` (drop its trainer and
    ``leave_group``), its store a new file in ``stores`` (``store_dir``); returns
    ``members``."""
    gather_members(client, [client.submit(leave_task, workers=[a], allow_other_workers=False,
                                          pure=False) for a in leavers], leavers)
    for stale in stores.glob(f"{STORE_PREFIX}*"):  # of groups every member has left
        stale.unlink(missing_ok=True)
    store_path = str(stores / f"{STORE_PREFIX}{uuid.uuid4().hex}")
    backend = backend_for(device)
    joined = [client.submit(join_group_task, store_path, r, members, backend, parallel,
                            workers=[address], allow_other_workers=False, pure=False)
              for r, address in enumerate(members)]
    gather_members(client, joined, members)
    return members
