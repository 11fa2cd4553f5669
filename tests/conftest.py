"""Test-session settings shared by every layer."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "TRITON_INTERPRET" not in os.environ:
    # Triton's interpreter must be on before triton is first imported (its own helpers are decorated then;
    # pagedgen.ops.triton_attention.triton_interpreting), so the Triton attention tests can run the kernels
    # on the CPU in any test order. With CUDA the kernels are compiled and run on the GPU instead.
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile(
    "pagedgen", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("pagedgen")
