"""Figures of the replicated server (docs/performance.md, "Replicas behind Ray Serve"), in one process.

Part 1, the affinity effect: conversations that share a system prompt, each turn resending the whole
conversation, served by two replicas with cache-affinity routing and then with random routing (the same
requests, the same cluster, redeployed between); the figure is the prompt tokens each routing had to prefill
(``prompt_tokens - cached_tokens`` summed over the answers). Part 2, throughput: the same batch of
concurrent requests through one replica (given both CPUs) and through two (one CPU each), repeated
interleaved, best of the repeats. Prints one JSON object; ``uptime``'s load average is sampled around each
measurement. Loopback only; every loop is bounded.

    PYTHONPATH=. python scripts/bench_replicas.py --model default --conversations 8 --turns 4

``--model synthetic`` serves the weightless synthetic model with a plain chat template: a smoke run of the
script itself in about a minute per deployment (its figures say nothing about a real model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

import httpx
import ray
from ray import serve

import pagedgen as pg
from pagedgen.server.app import ServerOptions
from pagedgen.server.replicas.application import APP_NAME, build_application
from pagedgen.server.replicas.launch import start_local_ray
from pagedgen.server.replicas.setup import SYNTHETIC, ModelSource, ReplicaSetup

SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle, and "
    "never invent a product. The store sells tools, paint, garden supplies, plumbing and electrical parts. "
) * 4  # about 300 tokens, shared by every conversation


SYNTHETIC_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


def _source(model: str) -> ModelSource:
    """The model every replica loads (the synthetic one with a chat template, so the chats run)."""
    return (
        ModelSource(SYNTHETIC, chat_template=SYNTHETIC_TEMPLATE) if model == SYNTHETIC else ModelSource(model)
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _deploy(args: argparse.Namespace, replicas: int, cpus: float, routing: str) -> None:
    setup = ReplicaSetup(
        source=_source(args.model),
        engine=pg.EngineConfig(max_batch_size=16, num_blocks=args.num_blocks),
        options=ServerOptions(model_name="m"),
        num_replicas=replicas,
        replica_cpus=cpus,
        routing=routing,
    )
    # Deleted first: a rolling update to more replicas would wait for CPUs the old version still holds.
    serve.delete(APP_NAME)
    serve.run(build_application(setup), name=APP_NAME, route_prefix="/")


async def _conversation(client: httpx.AsyncClient, index: int, turns: int) -> tuple[int, int]:
    """One conversation's (prompt tokens, cached tokens) over its turns."""
    messages = [{"role": "system", "content": SYSTEM}]
    prompt = cached = 0
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": f"Customer {index}, question {turn}: where is item {turn}?"}
        )
        body = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0}
        response = await client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        answer = response.json()
        prompt += answer["usage"]["prompt_tokens"]
        cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    return prompt, cached


async def _affinity_run(url: str, conversations: int, turns: int) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        results = await asyncio.gather(*(_conversation(client, i, turns) for i in range(conversations)))
    prompt = sum(p for p, _ in results)
    cached = sum(c for _, c in results)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens": prompt - cached}


async def _throughput_run(url: str, requests: int, max_tokens: int) -> float:
    """Generated tokens per second of ``requests`` concurrent distinct completions."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        start = time.perf_counter()
        bodies = [
            {
                "model": "m",
                "prompt": f"Story {i}: once upon a time",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            for i in range(requests)
        ]
        answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        elapsed = time.perf_counter() - start
    for answer in answers:
        answer.raise_for_status()
    return sum(a.json()["usage"]["completion_tokens"] for a in answers) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    start_local_ray(num_cpus=os.cpu_count(), log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    out: dict[str, object] = {"cpus": os.cpu_count(), "model": args.model}
    try:
        for routing in ("affinity", "random"):
            _deploy(args, 2, 1, routing)
            load = os.getloadavg()
            out[routing] = asyncio.run(_affinity_run(url, args.conversations, args.turns))
            out[routing]["load_before"] = load
            out[routing]["load_after"] = os.getloadavg()
        if not args.skip_throughput:
            rates: dict[str, list[float]] = {"1 replica, 2 CPUs": [], "2 replicas, 1 CPU each": []}
            for _ in range(args.repeats):
                for name, (replicas, cpus) in (
                    ("1 replica, 2 CPUs", (1, 2)),
                    ("2 replicas, 1 CPU each", (2, 1)),
                ):
                    _deploy(args, replicas, cpus, "affinity")
                    rates[name].append(asyncio.run(_throughput_run(url, args.requests, args.max_tokens)))
            out["throughput_tokens_per_s"] = {name: max(values) for name, values in rates.items()}
            out["throughput_all"] = rates
            out["load_end"] = os.getloadavg()
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
