"""Tensor-parallel ranks as Ray actors in a placement group (``tensor_parallel_launcher="ray"``).

The runner reserves a placement group of ``T`` bundles, one per rank: bundle 0 is rank 0's (the engine's
own process, pinned to the driver's node through Ray's ``node:<ip>`` resource so the reservation covers the
machine rank 0 runs on), bundles ``1..T-1`` hold one :class:`RankActor` each. ``STRICT_PACK`` (the default)
keeps every bundle on that one node; ``SPREAD`` (or ``PACK`` / ``STRICT_SPREAD``) lets Ray place them on
other machines. A bundle is one CPU on the CPU, one GPU and one CPU on CUDA.

An actor runs the same worker loop as a local subprocess (:func:`pagedgen.parallel.worker.worker_main`)
over a :class:`multiprocessing.connection.Connection`: it listens on its node's address with a per-runner
random key, rank 0 connects, and from then on the two launchers are indistinguishable to the runner. Why a
socket rather than an actor call per step: the messages keep their order and the runner's liveness checks
(a closed connection, a finished ``run`` task) stay what they are for a subprocess, with no Ray call on the
step's path. An actor whose loop fails sends ``Failed`` and exits its process (as a subprocess does), so
its sockets close and rank 0's collective fails at once instead of waiting out the timeout.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import uuid
from multiprocessing.connection import Client, Connection, Listener

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedgen.parallel.launch import Placement, RankFailedError, RankProcess
from pagedgen.parallel.plan import TensorParallelError

PLACEMENT_TIMEOUT_S = 120.0  # the cluster has this long to reserve the bundles
ACTOR_START_TIMEOUT_S = 600.0  # an actor's process starts and imports torch (slow on a loaded machine)
DRIVER_NODE_SHARE = 0.001  # of the driver node's ``node:<ip>`` resource: pins bundle 0 there


def node_address() -> str:
    """The address Ray knows this process's node by (the one its ``node:<ip>`` resource names: with
    ``ray.init(_node_ip_address=...)`` that address, where ``ray.util.get_node_ip_address`` reports the
    host's own)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def bundles(world: int, device: torch.device, driver_ip: str) -> list[dict[str, float]]:
    """The placement group's bundles: one per rank, bundle 0 on the driver's node."""
    unit = {"CPU": 1.0, "GPU": 1.0} if device.type == "cuda" else {"CPU": 1.0}
    out = [dict(unit) for _ in range(world)]
    out[0][f"node:{driver_ip}"] = DRIVER_NODE_SHARE
    return out


class RankActor:
    """One rank's process in the cluster: :meth:`listen`, then :meth:`run` (the worker loop) until Stop."""

    def __init__(self) -> None:
        self._listener: Listener | None = None

    def listen(self, authkey: bytes) -> tuple[str, int, int]:
        """Listen on this node's address (a free port); returns that address and this process's id."""
        self._listener = Listener((node_address(), 0), authkey=authkey)
        host, port = self._listener.address
        return host, port, os.getpid()

    def run(self) -> None:
        """Accept rank 0's connection and serve it; a failed loop ends this process (module docstring)."""
        from pagedgen.parallel.worker import worker_main

        listener, self._listener = self._listener, None
        if listener is None:
            raise RuntimeError("RankActor.run before listen")
        with listener:
            conn = listener.accept()
        worker_main(conn)  # its SystemExit on a failure ends this actor's process (Ray's rule for actors)


class RayRank:
    """Rank 0's handle on one actor: the actor, the task of its loop, its host and process id."""

    def __init__(self, name: str, actor: ray.actor.ActorHandle, run: ray.ObjectRef, host: str, pid: int):
        self.name, self.actor, self.run_task, self.host, self.pid = name, actor, run, host, pid

    @property
    def label(self) -> str:
        return f"Ray actor {self.name}, pid {self.pid} on {self.host}"

    def wait_ended(self, timeout_s: float) -> bool:
        """Whether the actor's loop has ended (returned, failed or died), waiting up to ``timeout_s``."""
        ready, _ = ray.wait([self.run_task], timeout=timeout_s)
        return bool(ready)

    def exit_reason(self) -> str | None:
        if not self.wait_ended(0):
            return None
        try:
            ray.get(self.run_task)
        except RayActorError as exc:
            return f"died ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        except RayError as exc:
            return f"failed ({type(exc).__name__})"
        return "ended"

    def stop(self, timeout_s: float) -> None:
        """Wait for the loop to end (after ``Stop``), then remove the actor and wait for its death."""
        with contextlib.suppress(RayError):
            self.wait_ended(timeout_s)
        ray.kill(self.actor, no_restart=True)
        with contextlib.suppress(RayError):
            self.wait_ended(timeout_s)


class RayLauncher:
    """Reserves the placement group at construction; starts rank ``r``'s actor in bundle ``r``."""

    def __init__(self, world: int, device: torch.device, placement: Placement):
        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS names an existing cluster; otherwise a local one for this process
        self.host = node_address()
        self._device = device
        self._key = secrets.token_bytes(32)
        self._prefix = f"pagedgen-tp-{uuid.uuid4().hex[:12]}"
        self.actor_names: list[str] = []
        self.bundles = bundles(world, device, self.host)
        self.placement_group = placement_group(self.bundles, strategy=placement.value, name=self._prefix)
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            self.close()
            raise TensorParallelError(
                f"the Ray cluster could not place {world} bundles {self.bundles[1]} ({placement.value}, the "
                f"first on this node {self.host}) within {PLACEMENT_TIMEOUT_S:.0f} s; available: "
                f"{ray.available_resources()}"
            ) from None

    @staticmethod
    def worker_device(device: torch.device, rank: int) -> str:
        return "cuda:0" if device.type == "cuda" else "cpu"  # Ray shows an actor only its own GPU

    def start(self, rank: int) -> tuple[RankProcess, Connection]:
        name = f"{self._prefix}-rank{rank}"
        gpus = 1 if self._device.type == "cuda" else 0
        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
        actor = (
            ray.remote(RankActor)
            .options(name=name, num_cpus=1, num_gpus=gpus, max_restarts=0, scheduling_strategy=strategy)
            .remote()
        )
        self.actor_names.append(name)
        try:
            host, port, pid = ray.get(actor.listen.remote(self._key), timeout=ACTOR_START_TIMEOUT_S)
            handle = RayRank(name, actor, actor.run.remote(), host, pid)
            return handle, Client((host, port), authkey=self._key)
        except (RayError, OSError, EOFError) as exc:
            ray.kill(actor, no_restart=True)
            reason = f"tensor-parallel rank {rank} (Ray actor {name}) did not start: {exc}"
            raise RankFailedError(reason) from exc

    def close(self) -> None:
        group, self.placement_group = self.placement_group, None
        if group is not None and ray.is_initialized():
            remove_placement_group(group)
