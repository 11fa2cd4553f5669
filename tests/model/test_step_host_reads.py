"""No host synchronisation inside a step (issue 17, item 2), counted on the CPU.

What this proves: with :class:`tests.host_reads.HostReads` tracking which tensors hold device data (the
step's transferred inputs, the KV cache, the fixed-state pool, the weights, and everything computed from
them), a whole engine step (plan, reserve, pack, the model's forward, sampling, staging, commit) reads
device data back to the host exactly once when it samples: the sampler's one copy of the tokens, bad-row
flags and logprobs (``Sampler._read_back``; on the CPU, all-greedy rows without logprobs are read once
through numpy by ``_host_argmax`` instead); and never when it samples nothing. That holds on the synthetic
model (plain, sliding-window rings, fixed state) and on a tiny Llama checkpoint (native fused path and the
torch attention path), for decode steps, mixed prefill + decode steps with partial prefills, greedy and
sampled rows with penalties, logprobs, guided rows and speculative drafts.

What only a GPU run can prove (``scripts/gpu_check.py`` and the CUDA-graph warm-up under
``torch.cuda.set_sync_debug_mode("error")``): that no pageable host-to-device copy or allocator event
stalls the stream, that the Triton kernels (interpreted on the CPU) launch without one, that the copies this
harness cannot tell apart from device-to-device ones on the CPU (``.to(device)`` with a device object) are
what they seem, and the time any of it costs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import pagedgen as pg
from pagedgen.models.model import Model
from pagedgen.ops.mixers import attention
from pagedgen.sampling.sampler import Sampler
from tests.helpers import drain, make_engine, submit, synthetic_model, turn_options
from tests.host_reads import HostReads, Read, mark_device_state, separate_device_copies
from tests.model.tiny_checkpoints import TINY_RAW, random_state, tiny_hf_model, write_hf_dir

pytestmark = pytest.mark.cpu  # counts reads of CPU tensors standing in for a device's

THE_COPY = Read("tolist", "pagedgen.sampling.sampler:_read_back")
# All-greedy rows without logprobs on the CPU are read once through numpy instead (the tensor's own memory;
# on a real device that path is never taken, the sampler's one copy is then THE_COPY).
THE_HOST_ARGMAX = Read("numpy", "pagedgen.sampling.sampler:_host_argmax")


class StepLog:
    """Per engine step: the host reads of device data, and whether the step sampled."""

    def __init__(self, engine: pg.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = HostReads()
        self.steps: list[tuple[list[Read], int]] = []  # (reads, sampler calls)
        separate_device_copies(self.reads, monkeypatch)
        mark_device_state(self.reads, engine)
        step = engine.parts.step
        run = step.run
        calls = [0]
        sample = Sampler.sample

        def counted_sample(sampler, *args, **kwargs):
            calls[0] += 1
            return sample(sampler, *args, **kwargs)

        monkeypatch.setattr(Sampler, "sample", counted_sample)

        def logged_run():
            start, calls[0] = len(self.reads.reads), 0
            with self.reads:
                result = run()
            self.steps.append((self.reads.reads[start:], calls[0]))
            return result

        monkeypatch.setattr(step, "run", logged_run)

    def assert_one_copy_per_sampling_step(self) -> None:
        assert self.steps, "no step ran"
        for index, (reads, sampler_calls) in enumerate(self.steps):
            assert len(reads) == sampler_calls, f"step {index}: {reads}"
            assert all(read in (THE_COPY, THE_HOST_ARGMAX) for read in reads), f"step {index}: {reads}"
        assert any(calls for _, calls in self.steps), "no step sampled"


def _mixed_workload(engine: pg.Engine, vocab: int) -> list[pg.Request]:
    """Greedy and sampled rows with processors and logprobs, prompts long enough for chunked prefill."""
    prompt = [(7 * i + 3) % (vocab - 1) for i in range(19)]
    return [  # the first step (12 tokens, chunks of 8) holds two partial prefills and samples nothing
        submit(engine, prompt, 5, do_sample=True, seed=3, temperature=0.7, top_k=20, top_p=0.9),
        submit(engine, prompt[2:], 4, logprobs=2, do_sample=True, seed=5, min_p=0.05, min_length=8),
        submit(engine, prompt[:5], 6),
        submit(engine, prompt[:9], 5, logprobs=3, repetition_penalty=1.2, no_repeat_ngram_size=2),
    ]


def _run_with_drafts(engine: pg.Engine, requests: list[pg.Request], propose: Callable) -> None:
    """Run to completion, proposing ``propose(request)`` as drafts whenever one of ``requests`` takes some."""
    buffer = engine.create_event_buffer(64)
    while engine.has_pending_requests():
        for request in requests:
            if request.ready_for_drafts:
                request.set_draft_tokens(propose(request))
        engine.run(buffer)


# ------------------------------------------------------------------------------------------ synthetic model


@pytest.mark.parametrize("variant", ["plain", "window", "hybrid"])
def test_a_synthetic_step_reads_the_device_once_when_it_samples(variant, monkeypatch):
    model = synthetic_model(window=4 if variant == "window" else None, hybrid=variant == "hybrid")
    engine = make_engine(model, max_batch_size=4, max_scheduled_tokens=12, chunk_size=8, max_draft_tokens=3)
    log = StepLog(engine, monkeypatch)
    requests = _mixed_workload(engine, model.vocab_size)
    drafting = [] if variant == "hybrid" else requests[2:]  # fixed state cannot commit a draft prefix
    _run_with_drafts(engine, drafting, lambda request: [1, 2])
    log.assert_one_copy_per_sampling_step()
    assert log.steps[0][1] == 0  # partial prefills only: no read at all
    assert (engine.stats().drafts_proposed > 0) == bool(drafting)


def test_guided_rows_add_no_read(monkeypatch):
    model = synthetic_model(eos_token_id=256)
    engine = make_engine(model, max_batch_size=4)
    log = StepLog(engine, monkeypatch)
    params = pg.GeneratorParams(engine.model)
    params.set_guidance("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")
    guided = engine.create_request(params, pg.RequestOptions())
    guided.begin_turn([5, 6, 7], turn_options(guided, 20))
    submit(engine, [1, 2, 3], 8, do_sample=True, seed=1)
    drain(engine)
    log.assert_one_copy_per_sampling_step()
    assert engine.stats().steps > 3


# ------------------------------------------------------------------------------------------ tiny Llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Model:
    path = write_hf_dir(tmp_path_factory.mktemp("tiny-llama"), TINY_RAW, random_state(TINY_RAW, seed=2))
    return Model(str(path), device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("path", ["fused", "torch"])
def test_a_tiny_llama_step_reads_the_device_once_when_it_samples(tiny_llama, path, monkeypatch):
    if path == "torch":  # the per-layer torch attention (SDPA buckets, write_kv's index_copy_)
        monkeypatch.setattr(attention, "decode_kernel", lambda: None)
        monkeypatch.setattr(tiny_llama.runtime, "fused_decoder", None)
    engine = make_engine(
        tiny_llama, max_batch_size=4, max_scheduled_tokens=12, chunk_size=8, max_draft_tokens=3
    )
    log = StepLog(engine, monkeypatch)
    requests = _mixed_workload(engine, tiny_llama.vocab_size)
    _run_with_drafts(engine, requests[1:3], lambda request: [4, 9, 4])
    log.assert_one_copy_per_sampling_step()
    assert log.steps[0][1] == 0
    assert engine.stats().drafts_proposed > 0


class ReadingRunner:
    """A runner that reads a host copy (free) and a packed device tensor (a read) before it executes."""

    def __init__(self, runner):
        self.runner = runner

    def execute(self, inputs):
        inputs.host.slot_mapping.tolist()  # host copy: free
        int(inputs.past_lens.max())  # device: a read
        return self.runner.execute(inputs)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_the_harness_sees_a_host_read_of_device_data(monkeypatch):
    """The counter itself: a read of a packed device tensor or of the model's output is recorded, a read
    of the host copies is not."""
    engine = make_engine(synthetic_model(), max_batch_size=2, wrap_runner=ReadingRunner)
    log = StepLog(engine, monkeypatch)
    submit(engine, [1, 2, 3], 2)
    drain(engine)
    assert all(reads[0].op == "__int__" for reads, _ in log.steps)
    assert all(reads[1:] == [THE_COPY] for reads, _ in log.steps)


def test_a_tiny_bamba_step_reads_the_device_once_when_it_samples(tmp_path, monkeypatch):
    """Mamba-2 mixers: the conv and the chunked scan plan from the host copy of the step's boundaries."""
    hf = tiny_hf_model("bamba", initializer_range=0.3)
    hf.save_pretrained(tmp_path)
    model = Model(str(tmp_path), device="cpu")
    engine = make_engine(model, max_batch_size=4, max_scheduled_tokens=12, chunk_size=8)
    log = StepLog(engine, monkeypatch)
    requests = _mixed_workload(engine, model.vocab_size)  # held: an unreferenced request is abandoned
    drain(engine)
    log.assert_one_copy_per_sampling_step()
    assert log.steps[0][1] == 0 and all(r.status is pg.RequestStatus.TURN_COMPLETE for r in requests)
