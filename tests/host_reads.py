"""Counting the host reads of device data in an engine step, on the CPU (tests/model/test_step_host_reads.py).

On a CPU-only machine every tensor is a host tensor, so "the device" has to be made explicit. A
:class:`HostReads` torch-function mode tracks which tensors hold device data:

- the step's packed inputs as transferred by ``pack_step`` (``stage_arrays`` is wrapped so that on the CPU the
  "device" tensors are copies, distinct from the host copies ``StepInputs.host`` keeps), and every tensor
  sent up with :func:`pagedgen.core.transfer.upload` (the sampler's and processors' indices and values),
- the long-lived device state: the KV cache, the fixed-state pool's banks, the model's weights and buffers,
- everything a torch operation computes from, or writes with, any of those (taint propagation),
- every tensor model code allocates (factories called from ``pagedgen.models`` / ``pagedgen.ops``: on a GPU
  they are device allocations, and on the CPU a kernel's output buffer would otherwise lose the taint).

A *host read* is an operation that, were those tensors on a GPU, would copy device data to the host or wait
for the device: ``.tolist()``, ``.item()``, ``bool()/int()/float()``/``__index__``, ``.numpy()``, ``.cpu()``,
``.to("cpu")``, ``torch.equal``, and the operations whose output size depends on device values (``nonzero``,
``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``). Each is
recorded with the pagedgen function that made it. The CPU-only BLAS call (``openblas_gemm``), which hands
tensors to numpy as its way of computing, is not counted.

What this cannot see: a ``.to(device)`` or ``copy_`` that moves device data to the host under another name
(on the CPU the device and the host are one, so only a literal ``"cpu"`` target is counted), work done
outside torch on a tensor's memory (the native kernels read it through ``data_ptr``, which is the CPU path's
execution, not a transfer), pageable host-to-device uploads (copies the other way, which stall the host on a
GPU without reading anything back), and anything in another thread. Those need a GPU run:
``torch.cuda.set_sync_debug_mode("error")`` in the CUDA-graph warm-up, and ``scripts/gpu_check.py``'s
profiler counts.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pagedgen.core import transfer
from pagedgen.executor import inputs as packing
from pagedgen.guidance import bitmask
from pagedgen.ops.matmul import gemm, linear

_READS = {
    "tolist",
    "item",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "numpy",
    "__array__",
    "cpu",
    "equal",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
# Tensors that model code allocates live on the model's device: on the CPU, allocations made from these
# packages (a forward, its ops and kernels' output buffers) are marked as device data.
_DEVICE_CODE = ("pagedgen.models.", "pagedgen.ops.")
_FACTORIES = {
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "tensor",
    "as_tensor",
    "from_numpy",
    "empty_strided",
}
# CPU-only kernels that hand a tensor's memory to numpy / BLAS: that is the CPU path's execution, never a
# transfer (they are selected for CPU tensors only), so their numpy views are not reads.
_CPU_KERNELS = {"pagedgen.ops.matmul.gemm:openblas_gemm"}
_MUTATING = {"__setitem__", "copy_", "index_put_", "index_copy_", "index_add_", "scatter_", "masked_fill_"}


@dataclass(frozen=True, slots=True)
class Read:
    """One host read: the operation and the pagedgen function (``module:function``) that made it."""

    op: str
    where: str


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _caller() -> str:
    """The innermost pagedgen frame of the current stack (``module:function``)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("pagedgen."):
            return f"{module}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class HostReads(TorchFunctionMode):
    """Taint-tracking torch-function mode: marks device tensors, records their host reads (:attr:`reads`)."""

    def __init__(self) -> None:
        super().__init__()
        self._device: dict[int, weakref.ref[torch.Tensor]] = {}
        self.reads: list[Read] = []

    def mark(self, *values: Any) -> None:
        """Mark every tensor in ``values`` (tensors, or lists / tuples / dicts of them) as device data."""
        for tensor in _tensors(list(values)):
            self._device[id(tensor)] = weakref.ref(tensor)

    def is_device(self, tensor: torch.Tensor) -> bool:
        ref = self._device.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tainted = any(self.is_device(t) for t in _tensors([args, kwargs]))
        if tainted and self._is_read(name, args, kwargs):
            where = _caller()
            if where not in _CPU_KERNELS:
                self.reads.append(Read(name, where))
        out = func(*args, **kwargs)
        if tainted or (name in _FACTORIES and _caller().startswith(_DEVICE_CODE)):
            self.mark(out)
            if name in _MUTATING or (name.endswith("_") and args and isinstance(args[0], torch.Tensor)):
                self.mark(args[0])
        return out

    @staticmethod
    def _is_read(name: str, args: tuple, kwargs: dict) -> bool:
        if name in _READS:
            return True
        if name == "repeat_interleave":
            return "output_size" not in kwargs and any(isinstance(a, torch.Tensor) for a in args[1:2])
        if name in _INDEXING:  # a boolean mask selects a number of elements only the device knows
            return any(t.dtype == torch.bool for t in _tensors(list(args[1:2])))
        if name == "to":
            targets = [*args[1:], kwargs.get("device")]
            return any(t == "cpu" for t in targets if isinstance(t, str))
        return False


def mark_device_state(reads: HostReads, engine: Any) -> None:
    """Mark the engine's long-lived device state: KV cache, fixed-state pool, model weights and buffers."""
    runner = engine.parts.runner
    reads.mark(runner.kv_cache.keys, runner.kv_cache.values)
    fixed = getattr(engine.parts.cache, "fixed", None)
    if fixed is not None:
        reads.mark(fixed._banks, fixed._gathered, fixed._staged)
    runtime = runner.runtime
    if isinstance(runtime, torch.nn.Module):
        reads.mark(list(runtime.parameters()), list(runtime.buffers()))
        for module in runtime.modules():  # plain tensor attributes (rotary tables, packed weights)
            reads.mark([v for v in vars(module).values() if isinstance(v, torch.Tensor)])


def separate_device_copies(reads: HostReads, monkeypatch: Any) -> None:
    """Make ``pack_step``'s device tensors copies of its host copies (as on a GPU) and mark them, and so the
    tensors :func:`pagedgen.core.transfer.upload` sends up; mark what the CPU BLAS kernel returns
    (``torch.from_numpy`` is invisible to a torch-function mode)."""
    original = packing.stage_arrays
    blas = gemm.openblas_gemm

    def tracked_blas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = blas(x, weight, bias)
        if any(reads.is_device(t) for t in (x, weight, bias) if t is not None):
            reads.mark(out)
        return out

    for module in (gemm, linear):  # each calls it by its own name
        monkeypatch.setattr(module, "openblas_gemm", tracked_blas)
    uploaded = transfer.upload

    def tracked_upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """What a GPU would hold after the upload: a device copy (on the CPU, ``upload`` returns ``host``)."""
        out = uploaded(host, device)
        out = out.clone() if out is host else out
        reads.mark(out)
        return out

    monkeypatch.setattr(transfer, "upload", tracked_upload)  # upload_values calls it through the module
    monkeypatch.setattr(bitmask, "upload", tracked_upload)  # it calls it by its own name

    def staged(fields: dict, device: torch.device) -> tuple[dict, dict]:
        host, dev = original(fields, device)
        dev = {name: tensor.clone() for name, tensor in dev.items()}
        reads.mark(dev)
        return host, dev

    monkeypatch.setattr(packing, "stage_arrays", staged)
