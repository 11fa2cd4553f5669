"""``pagedgen bench kernels`` on a tiny GGUF checkpoint: the table's structure (groups, calls and bytes per
forward, the roofline arithmetic), the hook clock's bookkeeping and the CLI's JSON. Times are not checked."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from torch import nn

from pagedgen.bench.cli import main
from pagedgen.bench.kernel_profile import (
    KernelProfile,
    KernelRow,
    ModuleClock,
    ModuleRole,
    format_profile_table,
    measure_stream_bandwidth,
    run_kernel_profile,
)
from pagedgen.models.model import Model
from pagedgen.ops.matmul import quant_gemm
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf

LAYERS = TINY_RAW["num_hidden_layers"]
CONTEXT = 9


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny-Q8_0.gguf"
    state = random_state(TINY_RAW, seed=5)
    write_gguf(path, "llama", state, TINY_RAW, qtype=gguf.GGMLQuantizationType.Q8_0, tokenizer=False)
    return path


def _by_group(profile: KernelProfile) -> dict[str, KernelRow]:
    return {r.group: r for r in profile.rows}


def test_every_kernel_of_a_layer_is_a_row_with_its_calls_and_bytes_per_forward(tiny_gguf):
    model = Model(str(tiny_gguf), device="cpu", weights="float32")
    profile, hooked = run_kernel_profile(model, "tiny", [5, 6, 7], context=CONTEXT, repeats=2, bandwidth=10e9)
    rows = _by_group(profile)
    assert set(rows) == {
        "qkv f32", "o f32", "gate_up f32", "down f32", "head", "attention", "activation", "norms",
        "residual + norm", "embedding", "rotary tables", "other",
    }  # fmt: skip
    assert [rows[g].calls for g in ("qkv f32", "o f32", "gate_up f32", "down f32", "attention")] == [
        LAYERS
    ] * 5
    assert rows["head"].calls == rows["embedding"].calls == 1
    assert rows["norms"].calls == 2  # the first layer's input norm and the final norm; the rest fuse the add
    assert rows["residual + norm"].calls == LAYERS
    hidden, inner, vocab = TINY_RAW["hidden_size"], TINY_RAW["intermediate_size"], TINY_RAW["vocab_size"]
    heads, kv_heads, d = (
        TINY_RAW["num_attention_heads"],
        TINY_RAW["num_key_value_heads"],
        TINY_RAW["head_dim"],
    )
    qkv_out = (heads + 2 * kv_heads) * d
    assert rows["qkv f32"].bytes_moved == LAYERS * (4 * qkv_out * hidden + 4 * (qkv_out + hidden))
    assert rows["down f32"].bytes_moved == LAYERS * (4 * hidden * inner + 4 * (hidden + inner))
    assert rows["head"].bytes_moved == 4 * vocab * hidden + 4 * (vocab + hidden)
    kv_row = kv_heads * d * 4
    assert rows["attention"].bytes_moved == LAYERS * (2 * kv_row * (CONTEXT + 2) + 3 * heads * d * 4)
    assert rows["embedding"].bytes_moved == 4 * hidden + 4 * hidden
    assert rows["rotary tables"].bytes_moved == 0 and rows["other"].bytes_moved == 0
    assert sum(r.seconds for r in profile.rows) > 0 and hooked > 0
    assert set(profile.forward_s) == {"per-layer"}  # float32 weights: no fused decoder
    record = profile.to_dict()
    assert record["bytes_per_forward"] == sum(r.bytes_moved for r in profile.rows)
    assert record["roofline_forward_ms"] == pytest.approx(record["bytes_per_forward"] / 10e9 * 1e3)
    head = next(k for k in record["kernels"] if k["group"] == "head")
    assert head["roofline_ms"] == pytest.approx(rows["head"].bytes_moved / 10e9 * 1e3)
    assert head["roofline_fraction"] == pytest.approx(head["roofline_ms"] / head["ms"])


def test_weights_kept_as_stored_are_grouped_by_format_and_the_fused_path_is_timed(tiny_gguf):
    if quant_gemm.quant_kernels() is None:
        pytest.skip("no native kernels here")
    model = Model(str(tiny_gguf), device="cpu")
    profile, _ = run_kernel_profile(model, "tiny", [5, 6, 7], context=CONTEXT, repeats=2, bandwidth=None)
    rows = _by_group(profile)
    assert {"qkv Q8_0", "o Q8_0", "gate_up Q8_0", "down Q8_0"} <= set(rows)
    hidden = TINY_RAW["hidden_size"]
    q8_row = hidden // 32 * 34  # a Q8_0 block: f16 scale + 32 int8
    assert rows["o Q8_0"].bytes_moved == LAYERS * (hidden * q8_row + 4 * (hidden + hidden))
    assert set(profile.forward_s) == {"per-layer", "fused"}
    assert all(row["roofline_ms"] is None for row in profile.to_dict()["kernels"])


def test_the_clock_splits_inclusive_time_into_each_modules_own():
    class Leaf(nn.Module):
        def forward(self, x):
            return x + 1

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Leaf(), Leaf()

        def forward(self, x):
            return self.b(self.a(x) * 2)

    root = Parent()
    roles = {m: ModuleRole(name or "root", 0) for name, m in root.named_modules()}
    ticks = iter(range(100))
    clock = ModuleClock(roles, clock=lambda: float(next(ticks)))
    with clock.attached():
        root(torch.zeros(3))  # root 0..5: a 1..2, b 3..4
        root(torch.zeros(3))  # root 6..11
    assert clock.calls == {root.a: 2, root.b: 2, root: 2}
    assert clock.exclusive == {root.a: 2.0, root.b: 2.0, root: 6.0}  # 5 - 1 - 1, twice
    clock.reset()
    assert clock.exclusive == {} and clock.calls == {}
    root(torch.zeros(3))  # detached: no hooks left
    assert clock.calls == {}


def test_the_table_has_a_row_per_group_and_a_sum_against_the_roofline():
    profile = KernelProfile("m", "native", 100, 3, 20e9)
    profile.rows = [KernelRow("down Q4_K", 30, 0.004, 40_000_000), KernelRow("other", 1, 0.001, 0)]
    lines = format_profile_table(profile).splitlines()
    assert lines[2] == "| down Q4_K | 30 | 4.000 | 80.0% | 40.00 | 10.0 | 2.000 | 50 |"
    assert lines[3] == "| other | 1 | 1.000 | 20.0% | 0.00 | — | — | — |"
    assert lines[4] == "| **sum** | | 5.000 | 100% | 40.00 | 8.0 | 2.000 | 40 |"


def test_stream_bandwidth_is_positive_and_rejects_empty_buffers():
    assert measure_stream_bandwidth(1 << 20, repeats=2) > 0
    with pytest.raises(ValueError, match="must be positive"):
        measure_stream_bandwidth(0)


def test_cli_writes_the_profile_and_refuses_the_synthetic_model(tmp_path, tiny_gguf, capsys):
    out = tmp_path / "kernels.json"
    common = ["kernels", "--repeats", "2", "--context", "5", "--no-bandwidth", "--threads", "1"]
    status = main([*common, "--model", str(tiny_gguf), "--weights", "float32", "--json", str(out)])
    assert status == 0
    document = json.loads(out.read_text())
    assert document["command"].startswith("pagedgen bench kernels")
    assert document["profile"]["context"] == 5 and document["profile"]["stream_gb_per_s"] is None
    assert {k["group"] for k in document["profile"]["kernels"]} >= {"qkv f32", "head", "attention"}
    assert "| **sum** |" in capsys.readouterr().out
    assert main([*common, "--model", "synthetic"]) == 2
    assert "the synthetic model has none" in capsys.readouterr().err
