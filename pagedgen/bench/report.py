"""Bench output: the markdown table, the JSON document, the PNG bar chart, and the ratios between systems.

The JSON document is ``{"machine": {...}, "records": [one per system and workload], ...}``; every record
has at least the keys ``workload``, ``system``, ``output_tokens_per_s``, ``total_tokens_per_s``,
``requests_per_s``, ``wall_s`` and ``roofline_fraction`` (None where a system did not run).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pagedgen.bench.extras import require
from pagedgen.bench.records import BenchRecord, RunStatus
from pagedgen.core.json_value import JsonObject, JsonValue

REQUIRED_KEYS = (
    "workload",
    "system",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "wall_s",
    "roofline_fraction",
)


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def speedups(records: Sequence[BenchRecord]) -> dict[tuple[str, str], float]:
    """``(workload, system) -> pagedgen output tok/s / system output tok/s`` for every system that ran."""
    paged = {
        r.workload: r.output_tokens_per_s
        for r in records
        if r.system == "pagedgen" and r.status is RunStatus.OK and r.output_tokens_per_s
    }
    return {
        (r.workload, r.system): paged[r.workload] / r.output_tokens_per_s
        for r in records
        if r.system != "pagedgen"
        and r.status is RunStatus.OK
        and r.output_tokens_per_s
        and r.workload in paged
    }


def markdown_table(records: Sequence[BenchRecord]) -> str:
    """One row per record: throughputs, wall time, roofline share, memory, cache use, match rate, speedup."""
    ratio = speedups(records)
    header = (
        "| workload | system | out tok/s | total tok/s | req/s | wall s | % roofline | peak RSS MiB "
        "| KV blocks | match | pagedgen / system |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in records:
        if r.status is not RunStatus.OK:
            lines.append(f"| {r.workload} | {r.system} | {r.status.value}: {r.reason} |" + " |" * 8)
            continue
        rss = None if r.peak_rss_bytes is None else r.peak_rss_bytes / 2**20
        blocks = "—" if r.kv_blocks_used is None else f"{r.kv_blocks_used}/{r.kv_blocks_total}"
        roof = None if r.roofline_fraction is None else 100 * r.roofline_fraction
        match = None if r.match_rate is None else 100 * r.match_rate
        speed = ratio.get((r.workload, r.system))
        cells = [
            r.workload,
            r.system,
            _num(r.output_tokens_per_s, ".1f"),
            _num(r.total_tokens_per_s, ".1f"),
            _num(r.requests_per_s, ".2f"),
            _num(r.wall_s, ".2f"),
            _num(roof, ".2f"),
            _num(rss, ".0f"),
            blocks,
            _num(match, ".1f") + ("" if match is None else "%"),
            _num(speed, ".2f") + ("" if speed is None else "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def json_document(records: Sequence[BenchRecord], **sections: JsonValue) -> JsonObject:
    """The JSON payload: every record, plus named extra sections (machine, profiles, command)."""
    document: JsonObject = dict(sections)
    document["records"] = [r.to_dict() for r in records]
    return document


def write_json(path: Path, document: JsonObject) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")


def plot_throughput(records: Sequence[BenchRecord], path: Path) -> bool:
    """Grouped bars of output tok/s per system, one group per workload; False when nothing ran."""
    ran = [r for r in records if r.status is RunStatus.OK and r.output_tokens_per_s]
    if not ran:
        return False
    require("matplotlib", "the throughput chart").use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in ran))
    systems = list(dict.fromkeys(r.system for r in ran))
    value = {(r.workload, r.system): r.output_tokens_per_s for r in ran}
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(workloads) * len(systems) / 2), 4.0))
    for k, system in enumerate(systems):
        xs = [w + k * width for w in range(len(workloads))]
        ys = [value.get((w, system), 0.0) for w in workloads]
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([w + width * (len(systems) - 1) / 2 for w in range(len(workloads))], workloads)
    ax.set_ylabel("output tokens / s")
    ax.set_title("pagedgen bench throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
