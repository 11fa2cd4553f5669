"""Runs vLLM's offline engine for ``pagedgen bench`` inside vLLM's own virtual environment.

Why a driver: vLLM's CPU build pins its own torch, so it lives in a separate venv and this file runs there as
a plain script (``<venv>/bin/python vllm_driver.py``) that imports only the standard library and vLLM, never
pagedgen, and speaks one JSON object per line each way. docs/performance.md, "Module notes: ops and bench",
has the rest.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: at run time this file imports nothing from pagedgen
    import vllm

    from pagedgen.core.json_value import JsonObject, JsonValue


def start(message: JsonObject) -> tuple[vllm.LLM, JsonObject]:
    import vllm

    args = {
        "model": message["model"],
        "dtype": "float32",
        "enforce_eager": bool(message["enforce_eager"]),
        "max_num_seqs": int(message["max_num_seqs"]),
        "seed": 0,
        # On the CPU backend this is the share of the NUMA node's memory vLLM reserves (its default, 0.92,
        # fails to start beside the bench's own process); 0.3 leaves gigabytes of KV cache for a small model.
        "gpu_memory_utilization": float(message.get("memory_fraction", 0.3)),
    }
    llm = vllm.LLM(**args)
    info = {
        "vllm": getattr(vllm, "__version__", "unknown"),
        "engine_args": args,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return llm, info


def generate(llm: vllm.LLM, requests: list[list[JsonValue]]) -> JsonObject:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for _, n in requests]
    begin = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - begin
    return {"outputs": [[int(t) for t in r.outputs[0].token_ids] for r in results], "wall_s": wall}


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints (Python or C) land on stderr, never in the protocol stream
    sys.stdout = sys.stderr
    llm = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if llm is None:
                try:
                    llm, info = start(message)
                    reply: JsonObject = {"ready": info}
                except ImportError as exc:
                    reply = {"skipped": f"vllm is not importable by {sys.executable}: {exc}"}
            else:
                reply = generate(llm, message["requests"])
        except Exception as exc:  # reported to the bench, which records the baseline as failed
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
