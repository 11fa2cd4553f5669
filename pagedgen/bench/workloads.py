"""Benchmark workloads, named (W1, W2, B1, R1, PP512, TG128) or from flags, built deterministically from text.

Prompts are windows of the token stream of :data:`BENCH_TEXT` (tokenised with the model's own tokenizer and
repeated as often as the longest prompt needs), each starting at its own seeded offset, so every system sees
the same real token ids and no two requests share a prompt. A *repeat* workload (R1) instead asks, through
the chat template, to repeat a fixed text word for word: whole sentences of the text from the start of
paragraph ``seed + i`` (request ``i``) on. The output copies its prompt, the case prompt-lookup speculative
decoding is for. Lengths are drawn from ``numpy``'s PCG64 with the workload's seed: the same spec and
tokenizer always give the same requests.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedgen.bench.loaded import BenchTokenizer

BENCH_TEXT = """\
The harbour town woke slowly in the winter months. Before the sun had cleared the eastern hills, the baker
on Quay Street had already lit his ovens, and the smell of bread drifted down to the water where the fishing
boats rocked against their ropes. Most of the fleet stayed in port when the wind came from the north, but
old Marta took her small blue boat out every morning, whatever the weather, because she said the sea was
kinder than the people who complained about it.

Her granddaughter, who had come from the city to spend a year at the school on the hill, did not understand
this at first. She had grown up with trains that ran every four minutes and shops that never closed, and the
long evenings of the harbour town felt to her like a clock that had stopped. There was one cinema, which
showed films two years after everyone else had seen them, and one library, which opened on Tuesdays and
Saturdays and smelled of damp paper and floor polish.

It was in the library that she found the ledger. It had been shelved between a history of the lighthouse and
a guide to the birds of the coast, and it was bound in green cloth that had faded almost to grey. Inside, in
a careful hand, someone had recorded every ship that entered the harbour between 1891 and 1903: its name,
its cargo, the port it had come from and the number of its crew. Some entries carried small notes in the
margin. A schooner from Bergen had brought timber and a dog that would not go back on board. A steamer had
arrived with coal and left with the schoolmaster's daughter, who was never mentioned again.

She began to read the ledger every Saturday, and then, because the librarian took pity on her, on Tuesdays
as well. She made lists of the ships and drew maps of their routes, and she asked her grandmother about the
names she did not recognise. Marta knew more than she expected. The family who owned the rope works had come
on one of those ships; the red house at the end of the harbour wall had been built by a captain who lost his
vessel in the storm of 1899 and decided that he had seen enough of the sea.

By the spring the girl had filled three notebooks. Her teacher suggested that she present what she had found
at the town meeting in May, and so, on a bright evening with the windows of the hall open to the gulls, she
stood in front of sixty people and told them the stories of their own streets. Afterwards an old man came up
to her and said that his grandfather was the boy who had kept the ledger, and that nobody had read it for
eighty years. He asked if he could borrow her notebooks. She said yes, and he returned them a week later with
a page of corrections and a photograph of the harbour taken in 1900, full of masts.

When the year was over and the time came to go back to the city, she found that she did not want to leave.
She had learned the names of the winds and the habits of the tides, and she could tell from the colour of
the water whether Marta would come home early. The trains in the city still ran every four minutes, and the
shops still never closed, but now she noticed how rarely anyone there looked up at the sky.
"""


@dataclass(frozen=True, slots=True)
class LengthRange:
    """Inclusive integer range ``[low, high]``; ``low == high`` is a fixed length."""

    low: int
    high: int

    def __post_init__(self) -> None:
        for name in ("low", "high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LengthRange.{name} must be a positive int, got {value!r}")
        if self.high < self.low:
            raise ValueError(f"LengthRange.high ({self.high}) must be >= low ({self.low})")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"100"`` or ``"32:512"``; raises ValueError naming the text."""
        try:
            low, _, high = text.partition(":")
            return cls(int(low), int(high) if high else int(low))
        except ValueError as exc:
            raise ValueError(f"length {text!r} must be N or LOW:HIGH with positive ints ({exc})") from exc

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        if self.low == self.high:
            return [self.low] * count
        return [int(v) for v in rng.integers(self.low, self.high + 1, size=count)]

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to run: how many requests, their prompt and output lengths, the seed; greedy and ignore-EOS.

    ``max_batch_size`` (None: the command's ``--max-batch-size``) pins the batch size a workload is defined
    for, e.g. ``B1`` measures single-request decoding. ``repeat``: the prompt asks the model to repeat a text
    window of ``input_len`` tokens (:func:`repeat_prompt`), so the prompt itself is a little longer.
    """

    name: str
    num_requests: int
    input_len: LengthRange
    output_len: LengthRange
    seed: int = 0
    max_batch_size: int | None = None
    repeat: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("WorkloadSpec.name must be non-empty")
        n = self.num_requests
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"WorkloadSpec.num_requests must be a positive int, got {n!r}")
        b = self.max_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(f"WorkloadSpec.max_batch_size must be None or a positive int, got {b!r}")

    def describe(self) -> str:
        prompt = f"repeat <= {self.input_len.high} text tokens" if self.repeat else f"prompt {self.input_len}"
        text = f"{self.num_requests} requests, {prompt}, output {self.output_len}"
        text += f", seed {self.seed}"
        return text if self.max_batch_size is None else f"{text}, batch {self.max_batch_size}"


W1 = WorkloadSpec("W1", 64, LengthRange(100, 100), LengthRange(128, 128))
W2 = WorkloadSpec("W2", 128, LengthRange(32, 512), LengthRange(16, 256))
B1 = WorkloadSpec("B1", 4, LengthRange(100, 100), LengthRange(128, 128), max_batch_size=1)
R1 = WorkloadSpec("R1", 4, LengthRange(160, 160), LengthRange(128, 128), max_batch_size=1, repeat=True)
# llama-bench's two standard tests as workloads, so every system runs them: a 512-token prefill (one token
# out; total tok/s is about the prompt rate) and 128 decode steps from a one-token prompt, at batch 1.
PP512 = WorkloadSpec("PP512", 4, LengthRange(512, 512), LengthRange(1, 1), max_batch_size=1)
TG128 = WorkloadSpec("TG128", 4, LengthRange(1, 1), LengthRange(128, 128), max_batch_size=1)
NAMED_WORKLOADS: dict[str, WorkloadSpec] = {w.name: w for w in (W1, W2, B1, R1, PP512, TG128)}
REPEAT_INSTRUCTION = "Repeat the following text exactly, word for word, and write nothing else:\n\n"


def workload_by_name(name: str) -> WorkloadSpec:
    spec = NAMED_WORKLOADS.get(name.upper())
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; named workloads: {', '.join(NAMED_WORKLOADS)}")
    return spec


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a built workload: real-text prompt ids and the exact number of tokens to generate."""

    index: int
    prompt_ids: tuple[int, ...]
    output_len: int


def text_tokens(tokenizer: BenchTokenizer) -> list[int]:
    """The token ids of :data:`BENCH_TEXT` under ``tokenizer``; raises ValueError if there are none."""
    tokens = [int(t) for t in tokenizer.encode(BENCH_TEXT)]
    if not tokens:
        raise ValueError("the tokenizer encoded the benchmark text to no tokens")
    return tokens


def build_workload(spec: WorkloadSpec, tokenizer: BenchTokenizer) -> list[BenchRequest]:
    """The requests of ``spec``: lengths, then prompt offsets, drawn in that order from one seeded stream.

    A prompt is ``stream[offset : offset + input_len]`` with ``offset`` in ``[0, len(text tokens))`` and the
    stream the text tokens repeated until every window fits.
    """
    rng = np.random.default_rng(spec.seed)
    input_lens = spec.input_len.draw(rng, spec.num_requests)
    output_lens = spec.output_len.draw(rng, spec.num_requests)
    base = text_tokens(tokenizer)
    stream = base * (1 + -(-spec.input_len.high // len(base)))
    offsets = rng.integers(0, len(base), size=spec.num_requests)
    requests = []
    for i, (n_in, n_out, off) in enumerate(zip(input_lens, output_lens, offsets, strict=True)):
        if spec.repeat:
            # Request i repeats from paragraph seed + i: distinct texts for up to six requests.
            prompt = repeat_prompt(tokenizer, repeat_text(tokenizer, spec.seed + i, n_in))
        else:
            prompt = stream[int(off) : int(off) + n_in]
        requests.append(BenchRequest(i, tuple(prompt), n_out))
    return requests


def repeat_text(tokenizer: BenchTokenizer, offset: int, max_tokens: int) -> str:
    """The text a repeat workload asks for: whole sentences of :data:`BENCH_TEXT` from the start of paragraph
    ``offset mod paragraphs`` on (continuing into the next paragraphs), as many as fit ``max_tokens`` tokens.
    Hard line breaks become spaces: a fixed text to copy, not a layout the model would reflow."""
    paragraphs = [" ".join(p.split()) for p in BENCH_TEXT.split("\n\n")]
    start = offset % len(paragraphs)
    sentences = [s for p in paragraphs[start:] + paragraphs[:start] for s in re.split(r"(?<=[.!?])\s+", p)]
    text = ""
    for sentence in sentences:
        longer = f"{text} {sentence}".strip()
        if len(tokenizer.encode(longer)) > max_tokens:
            break
        text = longer
    return text


def repeat_prompt(tokenizer: BenchTokenizer, text: str) -> list[int]:
    """Token ids of a user message asking to repeat ``text`` (chat template when the tokenizer has one, the
    bare message otherwise)."""
    message = REPEAT_INSTRUCTION + text
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is not None:
        return [int(t) for t in tokenizer.encode(template([{"role": "user", "content": message}]))]
    return [int(t) for t in tokenizer.encode(message)]


def workload_totals(requests: Sequence[BenchRequest]) -> tuple[int, int]:
    """``(prompt_tokens, output_tokens)`` summed over the requests."""
    return sum(len(r.prompt_ids) for r in requests), sum(r.output_len for r in requests)


def batches(requests: Sequence[BenchRequest], size: int) -> list[Sequence[BenchRequest]]:
    """Consecutive batches of at most ``size`` requests, in workload order."""
    if size <= 0:
        raise ValueError(f"batch size must be positive, got {size}")
    return [requests[i : i + size] for i in range(0, len(requests), size)]
