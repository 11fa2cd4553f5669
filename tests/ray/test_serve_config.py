"""``serve run deploy/serve.yaml``: Serve's own CLI deploys the repository's config file on a local cluster.

The file is the repository's, with what a test must change: the synthetic model (with a chat template, so
``/v1/chat/completions`` answers), a free port, a small engine, and ``autoscaling_config`` in place of the
file's commented example (one replica at most, which also shows the settings reach Serve: the file's
``replicas: 2`` would start two). Serve's config path resolves the ``import_path`` to our builder and its
``args`` to :class:`ApplicationArgs` in the cluster's controller, as ``serve deploy`` does. The ``openai``
client then chats, streaming and not, and SIGINT ends ``serve run``, which shuts the application down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import ray
import yaml
from ray import serve

from pagedgen.models.synthetic import synthetic_greedy
from pagedgen.server.replicas.launch import start_local_ray
from pagedgen.server.replicas.setup import SyntheticChatTokenizer
from tests.ray.cluster import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 600  # the bound of every wait: a cluster, Serve and a replica starting on a loaded 2-core machine
VOCAB = 257  # ModelSource("synthetic")'s default
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
MESSAGES = [{"role": "user", "content": "hello there, replicas"}]


def _config(port: int) -> dict:
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    assert app["import_path"] == "pagedgen.server.replicas.application:builder"
    assert app["args"]["replicas"] == 2
    app["args"].update(
        model="synthetic",
        chat_template=TEMPLATE,
        max_batch_size=8,
        num_blocks=256,
        shutdown_timeout=5,
        autoscaling_config={"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1},
    )
    return config


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-run")
    port = free_port()
    config_path = folder / "serve.yaml"
    config_path.write_text(yaml.safe_dump(_config(port)))
    start_local_ray(num_cpus=2, log_to_driver=False, configure_logging=False)
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", "--address", address]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log_path = folder / "serve-run.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*command, str(config_path)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path, WAIT_S, "the application of deploy/serve.yaml")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        serve.shutdown()
        ray.shutdown()


def _expected(max_tokens: int) -> str:
    codec = SyntheticChatTokenizer(VOCAB, TEMPLATE)
    prompt = codec.apply_chat_template(MESSAGES)
    assert prompt == "user: hello there, replicas\nassistant: "
    return codec.decode(synthetic_greedy(codec.encode(prompt), max_tokens, VOCAB))


def test_serve_run_of_the_repository_s_yaml_answers_the_openai_client(served):
    proc, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    answer = client.chat.completions.create(
        model="synthetic", messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert answer.choices[0].message.content == _expected(12)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 12 and answer.usage.prompt_tokens == len(
        "user: hello there, replicas\nassistant: "
    )
    chunks = list(
        client.chat.completions.create(
            model="synthetic", messages=MESSAGES, max_tokens=20, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == _expected(20)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="synthetic", messages=MESSAGES, temperature=9)

    metrics = httpx.get(url + "/metrics", timeout=60).text
    assert 'pagedgen:num_replicas{model_name="synthetic"} 1.0' in metrics  # autoscaling's bound, not 2
    status = serve.status().applications["pagedgen"]
    assert status.deployments["EngineReplica"].replica_states == {"RUNNING": 1}

    proc.send_signal(signal.SIGINT)  # serve run shuts Serve down and exits
    assert proc.wait(WAIT_S) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)
