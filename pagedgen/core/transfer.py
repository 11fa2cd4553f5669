"""Host-to-device copies of a step's small host values that never make the host wait for the device.

Why: on CUDA, ``torch.tensor(values, device="cuda")`` and ``.to("cuda")`` of pageable memory copy through a
staging buffer and block the host until the copy is done, which waits for every kernel queued before it (a
hidden synchronisation inside the step). From pinned memory with ``non_blocking=True`` the copy is queued on
the stream like a kernel and the host goes on; the caching host allocator keeps the pinned block alive until
the copy has run. On the CPU (and for any device that is not CUDA) the values are used as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: pinned and asynchronous on CUDA, itself on the CPU."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def upload_values(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | np.ndarray,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device`` (see :func:`upload`)."""
    if isinstance(values, np.ndarray):
        return upload(torch.from_numpy(values).to(dtype), device)
    return upload(torch.tensor(values, dtype=dtype), device)
