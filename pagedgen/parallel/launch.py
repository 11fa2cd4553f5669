"""How the ranks other than 0 are started: local worker processes, or Ray actors in a placement group.

Both launchers give rank 0 the same two things per rank: a :class:`multiprocessing.connection.Connection`
that carries the message protocol (:mod:`pagedgen.parallel.messages`) and a :class:`RankProcess` that says
whether the rank still runs. The rank's side is one implementation, :func:`pagedgen.parallel.worker.
worker_main` over that connection, whichever launcher started it:

- ``local`` (the default): ``python -m pagedgen.parallel FD`` subprocesses on this machine, each on an
  inherited pipe. Rank 0's store and the group are on loopback.
- ``ray``: one actor per rank in a placement group of ``T`` bundles (:mod:`pagedgen.parallel.ray_ranks`);
  the actor listens on its node's address and rank 0 connects to it (an authenticated socket), so the
  ranks may sit on other machines of the cluster. Rank 0's store is on the driver's node address.
"""

from __future__ import annotations

import contextlib
import enum
import multiprocessing
import os
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the CLI reads this module's choices without importing torch
    import torch

from pagedgen.errors import RankFailedError as RankFailedError

STOP_TIMEOUT_S = 10.0


class Launcher(enum.Enum):
    """``EngineConfig.tensor_parallel_launcher``: where ranks ``1..T-1`` run."""

    LOCAL = "local"
    RAY = "ray"


class Placement(enum.Enum):
    """``EngineConfig.tensor_parallel_placement``: the Ray placement group's strategy (Ray's own names).
    ``STRICT_PACK`` puts every rank on one node (rank 0's); ``SPREAD`` lets them go to other machines."""

    STRICT_PACK = "STRICT_PACK"
    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_SPREAD = "STRICT_SPREAD"


class RankProcess(Protocol):
    """A started rank: whether it still runs, and how to end it."""

    @property
    def label(self) -> str:
        """How error messages name it (``pid N``, ``Ray actor NAME``)."""
        ...

    def exit_reason(self) -> str | None:
        """How it ended (``exited with code -9``), or ``None`` while it runs."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for it to end by itself (after ``Stop``), then end it."""
        ...


class RankLauncher(Protocol):
    """Starts the ranks of one runner and removes what it set up."""

    @property
    def host(self) -> str:
        """The address the ranks reach rank 0's store at."""
        ...

    def worker_device(self, device: torch.device, rank: int) -> str:
        """The device rank ``rank`` runs on, named as that rank's process sees it."""
        ...

    def start(self, rank: int) -> tuple[RankProcess, Connection]:
        """Start rank ``rank``; its process and rank 0's end of its connection."""
        ...

    def close(self) -> None:
        """Remove what ``start`` set up beyond the ranks themselves (idempotent)."""
        ...


class LocalProcess:
    """A worker subprocess (``python -m pagedgen.parallel``).

    A subprocess rather than a multiprocessing spawn: spawn re-runs the caller's ``__main__`` in the child,
    which a script without a ``__main__`` guard cannot survive.
    """

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def label(self) -> str:
        return f"pid {self.process.pid}"

    def exit_reason(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"exited with code {code}"

    def stop(self, timeout_s: float) -> None:
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)


class LocalLauncher:
    """Ranks as local subprocesses on inherited pipes; loopback rendezvous; rank ``r`` on ``cuda:r``."""

    host = "127.0.0.1"

    def worker_device(self, device: torch.device, rank: int) -> str:
        return f"cuda:{rank}" if device.type == "cuda" else "cpu"

    def start(self, rank: int) -> tuple[RankProcess, Connection]:
        parent, child = multiprocessing.Pipe()
        fd = child.fileno()
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedgen.parallel", str(fd)], pass_fds=(fd,), env=dict(os.environ)
        )
        child.close()
        return LocalProcess(process), parent

    def close(self) -> None:
        return None


def stop_ranks(ranks: list[tuple[RankProcess, Connection]], launcher: RankLauncher) -> None:
    """Ask every rank to stop, end the ones that do not, then close the launcher. A finalizer's body: it
    holds no reference to the runner."""
    from pagedgen.parallel.messages import Stop

    for _, conn in ranks:
        with contextlib.suppress(OSError, ValueError):
            conn.send(Stop())
    for process, conn in ranks:
        with contextlib.suppress(Exception):  # teardown goes on for the other ranks
            process.stop(STOP_TIMEOUT_S)
        conn.close()
    launcher.close()
