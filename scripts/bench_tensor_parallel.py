"""Tensor-parallel figures for docs/performance.md: decode speed of T=2 against T=1 on this machine, the
per-layer path's cost (what T > 1 runs instead of the fused decode path), and each rank's weight bytes.

    PYTHONPATH=. python scripts/bench_tensor_parallel.py [--rounds 3] [--tokens 32] [--batch 1 4] \
        [--launcher ray]

Every variant runs in this one process, interleaved round by round, best of the rounds: ``T=1 fused`` (the
default engine, all CPUs), ``T=1 per-layer`` (the same with the fused decode path off), ``T=2`` (two ranks
over gloo, ``cpus // 2`` threads each; rank 1 a local process, or with ``--launcher ray`` a Ray actor on a
local cluster or the one ``RAY_ADDRESS`` names). Decode tokens per second over ``--tokens`` greedy steps
after the prefill, at each ``--batch`` size; the one-rank variants also at ``cpus // 2`` threads, one rank's
share.
Prints one JSON object (with the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pagedgen as pg
from pagedgen.ops.matmul.gemm_threads import configure_cpu_threads, usable_cpus
from pagedgen.parallel.shard import weight_bytes

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_rate(engine: pg.Engine, prompt: list[int], batch: int, tokens: int) -> float:
    """Greedy decode tokens per second of ``batch`` requests, timed from the first sampled token on (EOS
    held off by ``min_length``, so every request decodes ``tokens`` more)."""
    params = pg.GeneratorParams(engine.model)
    params.set_search_options(max_length=1024, do_sample=False, min_length=len(prompt) + tokens + 1)
    requests = []
    for _ in range(batch):
        request = engine.create_request(params)
        options = pg.TurnOptions(request)
        options.set_max_generated_tokens(tokens + 1)
        request.begin_turn(list(prompt), options)
        requests.append(request)
    seen, start = 0, None
    while engine.has_pending_requests():
        for event in engine.run(max_events=64):
            if event.flags & pg.EngineEventFlags.TOKEN:
                seen += 1
                if start is None and seen == batch:
                    start, seen = time.perf_counter(), 0
    elapsed = time.perf_counter() - start
    for request in requests:
        request.close()
    return seen / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--launcher", choices=["local", "ray"], default="local", help="how rank 1 starts")
    args = parser.parse_args()
    load_before = os.getloadavg()
    model = pg.Model("default")
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True)
    config = dict(max_batch_size=max(args.batch), num_blocks=256, prefix_caching=False)
    cpus = usable_cpus()
    one = pg.Engine(model, pg.EngineConfig(**config))
    two = pg.Engine(
        model, pg.EngineConfig(**config, tensor_parallel_size=2, tensor_parallel_launcher=args.launcher)
    )
    fused = model.runtime.fused_decoder
    share = max(1, cpus // 2)
    variants = {
        f"T=1 fused, {cpus} threads": (one, cpus, fused),
        f"T=1 per-layer, {cpus} threads": (one, cpus, None),
        f"T=1 fused, {share} thread(s)": (one, share, fused),
        f"T=1 per-layer, {share} thread(s)": (one, share, None),
        f"T=2, {share} thread(s) per rank": (two, share, fused),
    }
    best: dict[str, dict[int, float]] = {name: {} for name in variants}
    for _ in range(args.rounds):
        for batch in args.batch:
            for name, (engine, threads, decoder) in variants.items():
                configure_cpu_threads(threads)
                model.runtime.fused_decoder = decoder
                rate = decode_rate(engine, prompt, batch, args.tokens)
                best[name][batch] = max(best[name].get(batch, 0.0), rate)
    model.runtime.fused_decoder = fused
    runner = two.parts.runner
    result = {
        "decode_tokens_per_s_best_of": best,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "cpus": cpus,
        "launcher": args.launcher,
        "weight_bytes": {"T=1": weight_bytes(model.runtime), "T=2 per rank": runner.rank_weight_bytes},
        "kv_heads_rank0": runner.kv_cache.keys[0].shape[2],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    two.close()
    one.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
