"""A running stream's largest inter-token gap while six huge chat requests arrive (docs/server.md).

Usage: ``python scripts/hostile_gap.py TREE CHARS`` starts ``pagedgen serve --model default
--max-batch-size 8`` with ``PYTHONPATH=TREE`` in its own process on 127.0.0.1, streams a greedy 160-token
completion, and once 20 tokens have arrived sends six chat requests whose content is CHARS characters (the
body encoded once, so the client's JSON work shares no GIL with the server). Prints one JSON line: the six
statuses, the stream's largest gap before and during the burst, how long the burst took, a ``/health``
latency and the load average. Bounded: one stream, six requests, every wait has a timeout; the server is
stopped at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

STREAM_TOKENS = 160
BURST = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(tree: str, port: int) -> subprocess.Popen:
    argv = [
        os.path.join(os.path.dirname(sys.executable), "pagedgen"),
        *("serve", "--model", "default", "--host", "127.0.0.1", "--port", str(port)),
        *("--max-batch-size", "8", "--num-blocks", "512", "--max-body-bytes", str(8 << 20)),
        *("--log-level", "warning"),
    ]
    env = {**os.environ, "PYTHONPATH": tree}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_healthy(url: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def measure(url: str, chars: int) -> dict:
    content = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]
    message = {"role": "user", "content": content}
    body = json.dumps({"model": "default", "messages": [message], "max_tokens": 8}).encode()
    stamps: list[float] = []
    statuses: list[int] = []

    def stream() -> None:
        request = {"model": "default", "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS}
        request.update(stream=True, temperature=0, ignore_eos=True)
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())

    def huge() -> None:
        headers = {"content-type": "application/json"}
        statuses.append(
            httpx.post(url + "/v1/chat/completions", content=body, headers=headers, timeout=600).status_code
        )

    streamer = threading.Thread(target=stream)
    streamer.start()
    deadline = time.monotonic() + 600
    while len(stamps) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    burst = time.perf_counter()
    senders = [threading.Thread(target=huge) for _ in range(BURST)]
    for sender in senders:
        sender.start()
    time.sleep(0.2)
    asked = time.perf_counter()
    httpx.get(url + "/health", timeout=600)
    health = time.perf_counter() - asked
    for sender in senders:
        sender.join(600)
    done = time.perf_counter()
    streamer.join(600)
    gaps = list(zip(stamps, stamps[1:], strict=False))
    return {
        "chars": chars,
        "statuses": sorted(statuses),
        "tokens": len(stamps),
        "max_gap_before_s": round(max(b - a for a, b in gaps if b <= burst), 3),
        "max_gap_during_s": round(max(b - a for a, b in gaps if b >= burst and a <= done), 3),
        "burst_s": round(done - burst, 2),
        "health_s": round(health, 3),
        "load": os.getloadavg(),
    }


def main() -> None:
    tree, chars = sys.argv[1], int(sys.argv[2])
    port = _free_port()
    server = _start(tree, port)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        print(json.dumps({"tree": tree, **measure(url, chars)}))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
