"""Session-wide real-model fixtures: our default model and transformers' reading of the same GGUF file.

transformers takes tens of seconds to dequantise the GGUF file (and seconds more for its tokenizer), so
each is loaded once per test session and shared.
"""

from __future__ import annotations

import pytest
import torch

from pagedgen.models.checkpoint import default_gguf_path
from pagedgen.models.model import Model


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread: on a shared, oversubscribed CPU, two spinning OpenMP threads run 2-10x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def default_model_float32() -> Model:
    """The same file dequantised to float32 at load (``weights="float32"``)."""
    return Model("default", dtype=torch.float32, device="cpu", weights="float32")


@pytest.fixture(params=["native", "float32"])
def default_model_each_format(request, default_model, default_model_float32) -> Model:
    """The default model once per weight format (the default load is native where the kernels exist)."""
    return default_model if request.param == "native" else default_model_float32


@pytest.fixture(scope="session")
def hf_default_model():
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer():
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
