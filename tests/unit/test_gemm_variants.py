"""The native GEMM's instruction-set variants: picked by the host and ``in_features`` alone, every one equal
to ``F.linear`` within fp32 rounding, and each row's bits independent of its batch and of the thread count.

The variant a k selects is compiled for this host (``-march=native``), so which of these run depends on the
CPU: the AVX-512 cases run on an AVX-512 host, the AVX2 ones on AVX2 and AVX-512 hosts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedgen.ops.kernels.cpu_info import RELEVANT_FEATURES, cpu_features, cpu_flags, cpu_model
from pagedgen.ops.kernels.native import gemm_kernel, native_status

pytestmark = pytest.mark.cpu  # the native GEMM's CPU instruction-set variants


def _kernel():
    kernel = gemm_kernel()
    if kernel is None:
        pytest.skip(native_status().detail)
    return kernel


def _expected_variant(k: int) -> str:
    features = cpu_features()
    if "avx512f" in features and k % 16 == 0:
        return "avx512"
    if {"avx2", "fma"} <= set(features) and k % 8 == 0:
        return "avx2"
    return "portable"


def test_cpu_features_are_the_relevant_flags_of_this_cpu():
    features = cpu_features()
    assert set(features) <= set(cpu_flags()) and set(features) <= set(RELEVANT_FEATURES)
    assert list(features) == [f for f in RELEVANT_FEATURES if f in features]  # the documented order
    assert cpu_model()


@pytest.mark.parametrize("k", [576, 1536, 64, 16, 8, 24, 100, 9])
def test_the_variant_follows_the_host_and_k(k):
    assert _kernel().variant(k) == _expected_variant(k)


# k 576/64: the 16-wide tile where the host has AVX-512; 24: the 8-wide tile; 100: the portable loop.
# out 198: quads plus two leftover outputs; rows 1-13 cover every partial tile height of both tiles.
@pytest.mark.parametrize("k", [576, 64, 24, 100])
def test_every_row_has_the_same_bits_alone_in_any_batch_and_on_any_thread_count(k):
    kernel = _kernel()
    gen = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(13, k, generator=gen), torch.randn(198, k, generator=gen), torch.randn(198)
    batch = kernel(x, w, b)
    assert float((batch - F.linear(x, w, b)).abs().max()) <= 1e-5 * float(batch.abs().max())
    for rows in range(1, 14):
        assert torch.equal(kernel(x[:rows], w, b), batch[:rows]), rows
        assert torch.equal(kernel(x[13 - rows :], w, b), batch[13 - rows :]), rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = kernel(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, batch)
