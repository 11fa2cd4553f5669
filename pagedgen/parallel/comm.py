"""The ranks' process group: the rendezvous, gloo on the CPU, NCCL on CUDA, and the all-reduce.

The group is built from torch.distributed's backend classes over a ``TCPStore`` that rank 0 serves on a
free port (the operating system picks it: no port race), not through ``init_process_group``: no global
default group, so one process may hold several engines (tests compare one rank with two in one process).
The store's address is loopback for local worker processes and rank 0's node address for Ray actors on
other machines (:mod:`pagedgen.parallel.launch`).

Every collective carries the group's timeout: a rank that dies closes its sockets and the others' next
collective fails at once ("Connection closed by peer"); a rank that hangs fails them after the timeout.
Either way the caller gets an error, never a hang. The backend follows the ranks' device
(:func:`backend_for`); the NCCL path is written but has not run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedgen.parallel.plan import TensorParallelError

DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer fails
JOIN_TIMEOUT_S = 600.0  # the rendezvous waits for every rank's process to start (imports, under load)


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where the ranks meet: rank 0's store, the world size and the collectives' timeout (the rendezvous
    itself may take up to ``JOIN_TIMEOUT_S``)."""

    host: str
    port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


def backend_for(device: torch.device) -> str:
    """The collective backend for ranks on ``device``: NCCL for CUDA, gloo for the CPU. Raises
    :class:`TensorParallelError` naming any other device type (no backend of ours runs there)."""
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise TensorParallelError(
        f"tensor parallelism runs on cpu (gloo) or cuda (nccl) devices, not {device.type!r}"
    )


def serve_store(
    world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, host: str = "127.0.0.1"
) -> tuple[dist.TCPStore, GroupAddress]:
    """Rank 0's store on a free port, and the address the other ranks join at (``host``: the address
    they reach rank 0 by; loopback for local processes)."""
    store = dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        wait_for_workers=False,
    )
    return store, GroupAddress(host, int(store.port), world_size, timeout_s)


class GroupAllReduce:
    """Sums a tensor over the group in place (the row-parallel layers' one collective), failing after
    ``timeout_s``."""

    def __init__(self, group: dist.ProcessGroup | object, store: dist.Store, timeout_s: float):
        self._group = group
        self._store = store  # the rendezvous lives as long as the group
        self._options = dist.AllreduceOptions()
        self._options.timeout = timedelta(seconds=timeout_s)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._group.allreduce([x], self._options).wait()
        return x


def join_group(
    address: GroupAddress, rank: int, device: torch.device, store: dist.Store | None = None
) -> GroupAllReduce:
    """Join the group as ``rank`` (blocks until every rank has joined, at most ``JOIN_TIMEOUT_S``) with
    :func:`backend_for` ``device``. ``store``: rank 0's own; the others connect to ``address``."""
    backend = backend_for(device)
    timeout = timedelta(seconds=JOIN_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(
            address.host, address.port, address.world_size, is_master=False, timeout=timeout
        )
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, address.world_size, timeout)
    return GroupAllReduce(group, store, address.timeout_s)
