"""The physical KV storage: geometry, byte accounting and zero-initialised (lazily paged) tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedgen.core.kv import KVSpec, PagedKVCache, zeroed_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zeroed_tensor_is_writable_zeros_of_the_asked_dtype(dtype):
    t = zeroed_tensor((64, 16, 3, 8), dtype, "cpu")
    assert t.dtype == dtype and t.shape == (64, 16, 3, 8) and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    t[3, 2] = 1.5
    assert float(t.sum()) == pytest.approx(1.5 * 3 * 8)


def test_cache_has_one_key_and_value_tensor_per_layer():
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4)
    cache = PagedKVCache(spec, num_blocks=5, block_size=7)
    assert len(cache.keys) == len(cache.values) == 3
    assert all(t.shape == (5, 7, 2, 4) and torch.count_nonzero(t) == 0 for t in cache.keys + cache.values)
    assert cache.keys[0].data_ptr() != cache.values[0].data_ptr()
    assert spec.bytes_per_block(7) == 2 * 3 * 7 * 2 * 4 * 4


def test_cache_refuses_empty_geometry():
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(KVSpec(1, 1, 1), num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="head_dim"):
        KVSpec(num_layers=1, num_kv_heads=1, head_dim=0)


def test_windowed_layers_get_the_window_pools_tensors_when_they_keep_rings():
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, window_size=8, window_layers=(0, 2))
    assert spec.full_layers == (1,)
    assert spec.bytes_per_full_block(7) + spec.bytes_per_window_block(7) == spec.bytes_per_block(7)
    assert spec.bytes_per_window_block(7) == 2 * spec.bytes_per_full_block(7)
    rings = PagedKVCache(spec, num_blocks=5, block_size=7, window_blocks=3)
    assert rings.window_ring and [t.shape[0] for t in rings.keys] == [3, 5, 3]
    masked = PagedKVCache(spec, num_blocks=5, block_size=7)  # no rings: windowed layers stored like full ones
    assert not masked.window_ring and [t.shape[0] for t in masked.values] == [5, 5, 5]
    with pytest.raises(ValueError, match="needs a positive count and windowed layers"):
        PagedKVCache(KVSpec(1, 1, 1), num_blocks=5, block_size=7, window_blocks=3)


@pytest.mark.parametrize(
    ("window", "layers", "message"),
    [
        (8, (), "given together"),
        (None, (0,), "given together"),
        (0, (0,), "positive"),
        (8, (0, 3), "distinct"),
    ],
)
def test_kv_spec_refuses_an_inconsistent_window(window, layers, message):
    with pytest.raises(ValueError, match=message):
        KVSpec(num_layers=3, num_kv_heads=1, head_dim=2, window_size=window, window_layers=layers)


def _vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` in /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeroed_tensor_pages_are_advised_against_huge_pages():
    """A first write to a block must fault in its own 4 KiB pages, not the 2 MiB around it (which cost the
    first 32-prompt prefill of a 270M model 7 of its 12.7 s): the mapping carries MADV_NOHUGEPAGE."""
    t = zeroed_tensor((4096, 16, 1, 256), torch.float32, "cpu")  # 64 MiB
    assert "nh" in _vm_flags_of(t.data_ptr())
    t[4000, 3] = 2.0
    assert float(t.sum()) == 2.0 * 256
