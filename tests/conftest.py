"""Test-session settings and the fixtures every layer shares."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "TRITON_INTERPRET" not in os.environ:
    # Triton's interpreter must be on before triton is first imported (its own helpers are decorated then;
    # pagedgen.ops.mixers.triton_attention.triton_interpreting), so the Triton attention tests can run the
    # kernels on the CPU in any test order. With CUDA the kernels are compiled and run on the GPU instead.
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

settings.register_profile(
    "pagedgen", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("pagedgen")


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model, loaded once per session for every layer: native weights (Q4_1 layers,
    Q8_0 embedding and head) where the kernels exist, float32 on the CPU, where the model tests compare it
    with transformers and the server tests with the engine run directly."""
    import torch

    from pagedgen.models.model import Model

    return Model("default", dtype=torch.float32, device="cpu")
