"""The ranks' process group: a loopback rendezvous, gloo on the CPU, NCCL on CUDA, and the all-reduce.

The group is built from torch.distributed's backend classes over a ``TCPStore`` that rank 0 serves on a
free port (the operating system picks it: no port race), not through ``init_process_group``: no global
default group, so one process may hold several engines (tests compare one rank with two in one process).

Every collective carries the group's timeout: a rank that dies closes its sockets and the others' next
collective fails at once ("Connection closed by peer"); a rank that hangs fails them after the timeout.
Either way the caller gets an error, never a hang. The NCCL path is written but has not run on hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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


def serve_store(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, GroupAddress]:
    """Rank 0's store on a free loopback port, and the address the other ranks join at."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        wait_for_workers=False,
    )
    return store, GroupAddress("127.0.0.1", int(store.port), world_size, timeout_s)


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
    """Join the group as ``rank`` (blocks until every rank has joined, at most ``JOIN_TIMEOUT_S``): gloo
    for CPU tensors, NCCL for CUDA tensors. ``store``: rank 0's own; the others connect to ``address``."""
    timeout = timedelta(seconds=JOIN_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(
            address.host, address.port, address.world_size, is_master=False, timeout=timeout
        )
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, address.world_size, timeout)
    return GroupAllReduce(group, store, address.timeout_s)
