"""bench.records, bench.report, bench.roofline: exact arithmetic of records, match rates, FLOPs, tables."""

from __future__ import annotations

import json

import pytest

from pagedgen.bench.records import (
    RunStatus,
    SystemRun,
    common_prefix,
    make_record,
    match_stats,
)
from pagedgen.bench.report import REQUIRED_KEYS, json_document, markdown_table, speedups, write_json
from pagedgen.bench.roofline import FlopModel, flop_model_of, measure_gemm_flops
from pagedgen.bench.workloads import BenchRequest
from pagedgen.models.synthetic import SyntheticModel

REQUESTS = [BenchRequest(0, (1, 2, 3), 4), BenchRequest(1, (5, 6), 2)]


def test_match_rate_counts_common_prefixes():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    stats = match_stats([[1, 2, 3, 4], [7, 8]], [[1, 2, 9, 4], [7, 8]])
    # request 0 diverges at token 2 (the later equal token 4 does not count), request 1 is identical
    assert (stats.matched_tokens, stats.compared_tokens, stats.exact_requests) == (4, 6, 1)
    assert stats.rate == pytest.approx(4 / 6)
    assert match_stats([], []).rate == 1.0
    with pytest.raises(ValueError, match="1 outputs to compare with 2 reference outputs"):
        match_stats([[1], [2]], [[1]])


def test_record_of_a_run_has_exact_rates():
    run = SystemRun(
        [[9, 9, 9, 9], [8, 8]], wall_s=2.0, kv_blocks_used=3, kv_blocks_total=10, details={"steps": 5}
    )
    record = make_record(
        "W",
        "hf-static",
        REQUESTS,
        run,
        model_flops=8e9,
        peak_flops=1e10,
        peak_rss_bytes=123,
        reference=[[9, 9, 1, 1], [8, 8]],
    )
    assert record.status is RunStatus.OK and record.reason is None
    assert (record.num_requests, record.prompt_tokens, record.output_tokens) == (2, 5, 6)
    assert record.requests_per_s == 1.0
    assert record.output_tokens_per_s == 3.0
    assert record.total_tokens_per_s == 5.5
    assert record.roofline_fraction == pytest.approx(0.4)  # 8 GFLOP in 2 s on a 10 GFLOP/s machine
    assert (record.matched_tokens, record.compared_tokens, record.exact_match_requests) == (4, 6, 1)
    assert record.match_rate == pytest.approx(4 / 6)
    assert (record.kv_blocks_used, record.kv_blocks_total, record.peak_rss_bytes) == (3, 10, 123)
    assert record.details == {"steps": 5}


def test_a_run_with_wrong_lengths_is_refused():
    with pytest.raises(ValueError, match="request 1 produced 3 tokens, the workload asked for 2"):
        make_record("W", "x", REQUESTS, SystemRun([[1, 2, 3, 4], [1, 2, 3]], 1.0))


def test_skip_record_and_json_schema():
    skipped = make_record("W", "vllm", REQUESTS, None, status=RunStatus.SKIPPED, reason="not importable")
    data = skipped.to_dict()
    assert all(key in data for key in REQUIRED_KEYS)
    assert data["status"] == "skipped" and data["reason"] == "not importable"
    assert data["output_tokens_per_s"] is None and data["roofline_fraction"] is None
    assert json.loads(json.dumps(data)) == data  # plain JSON types only
    with pytest.raises(ValueError, match="must be SKIPPED or FAILED"):
        make_record("W", "vllm", REQUESTS, None)


def test_markdown_table_and_speedups(tmp_path):
    paged = make_record("W", "pagedgen", REQUESTS, SystemRun([[1] * 4, [1] * 2], 1.0))
    hf = make_record(
        "W", "hf-static", REQUESTS, SystemRun([[1] * 4, [1] * 2], 3.0), reference=[[1] * 4, [1] * 2]
    )
    skip = make_record("W", "vllm", REQUESTS, None, status=RunStatus.SKIPPED, reason="not here")
    records = [paged, hf, skip]
    assert speedups(records) == {("W", "hf-static"): pytest.approx(3.0)}
    lines = markdown_table(records).splitlines()
    assert lines[0].startswith("| workload | system | out tok/s |")
    assert lines[2] == "| W | pagedgen | 6.0 | 11.0 | 2.00 | 1.00 | — | — | — | — | — |"
    assert lines[3] == "| W | hf-static | 2.0 | 3.7 | 0.67 | 3.00 | — | — | — | 100.0% | 3.00x |"
    assert lines[4].startswith("| W | vllm | skipped: not here |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    path = tmp_path / "out" / "bench.json"
    write_json(path, json_document(records, machine={"cpus": 2}))
    loaded = json.loads(path.read_text())
    assert loaded["machine"] == {"cpus": 2}
    assert [(r["workload"], r["system"], r["status"]) for r in loaded["records"]] == [
        ("W", "pagedgen", "ok"),
        ("W", "hf-static", "ok"),
        ("W", "vllm", "skipped"),
    ]


class _Config:
    hidden_size, head_dim, num_heads, num_kv_heads = 8, 2, 4, 2
    intermediate_size, num_layers, vocab_size = 16, 3, 100


def test_flop_model_counts_linear_attention_and_head():
    flops = FlopModel.from_config(_Config())
    # per layer: q 8x8 + k,v 2 x 8x4 + o 8x8 + mlp 3 x 8x16 = 64 + 64 + 64 + 384
    assert flops.linear_params == 3 * 576
    assert flops.attention_coeff == 4 * 3 * 4 * 2
    assert flops.head_flops == 2 * 8 * 100
    # prompt 3, output 2: tokens forwarded 4 (context 1+2+3+4 = 10), logits rows 2
    assert flops.request_flops(3, 2) == 2 * 1728 * 4 + 96 * 10 + 1600 * 2
    requests = [BenchRequest(0, (1, 2, 3), 2), BenchRequest(1, (1,), 1)]
    assert flops.workload_flops(requests) == flops.request_flops(3, 2) + flops.request_flops(1, 1)
    assert flop_model_of(SyntheticModel()) is None


def test_gemm_peak_is_a_positive_rate_and_refuses_bad_sizes():
    assert measure_gemm_flops(size=64, repeats=2) > 0
    with pytest.raises(ValueError, match="must be positive"):
        measure_gemm_flops(size=0)
