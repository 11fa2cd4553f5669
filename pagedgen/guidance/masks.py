"""The step's token masks: one batched llguidance call for every guided row, overlapped with the forward.

A dynamic step submits its guided rows (:class:`MaskRow`: a cursor, its first logits row and its drafts)
before the model runs; a worker thread runs one ``LLExecutor`` call over all of them (llguidance drops the
GIL and spreads the rows over its own threads, as many as this process may use) while the owner thread
runs the forward pass, and the sampler joins the result. A row with drafts ``d_1..d_K`` gets K+1 masks: row
``i`` is the mask after ``d_1..d_i``; llguidance stops at the first draft its grammar rejects and the rows
after it keep the pass-through mask they were allocated with (those outputs are discarded by draft
verification, but must still be sampleable). Unguided rows and partial prefills get no mask at all.

A cursor that is poisoned, or that llguidance reports in error after computing its mask, is reported in
:attr:`MaskResult.failed` (the step fails that request alone). The computation changes no cursor's
position; it only records a poisoning llguidance reported.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import torch

from pagedgen.guidance.bitmask import TokenMasks, bitmask_words
from pagedgen.guidance.cursor import GrammarCursor
from pagedgen.guidance.spec import GuidanceError


def available_cpus() -> int:
    """CPUs this process may run on (its affinity set, which containers and ``taskset`` narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(slots=True, frozen=True)
class MaskRow:
    """One guided sampling row of a step."""

    request_id: int
    cursor: GrammarCursor
    row: int  # the row's first logits row; its drafts' rows follow it
    drafts: tuple[int, ...] = ()


@dataclass(slots=True)
class MaskResult:
    """What one batched computation produced."""

    masks: TokenMasks
    failed: list[tuple[int, GuidanceError]] = field(default_factory=list)  # (request id, error), row order
    seconds: float = 0.0  # wall time of the computation


@dataclass(slots=True)
class MaskStats:
    """Lifetime counters of an engine's mask work (rolled-back steps included: the work was done)."""

    rows_masked: int = 0  # mask rows computed (a row with K drafts counts K + 1)
    mask_seconds: float = 0.0  # wall time of the batched llguidance calls (on the worker)
    wait_seconds: float = 0.0  # wall time sampling waited for masks after the forward pass


class PendingMasks:
    """A submitted computation; :meth:`result` joins it (once) and accounts for the wait."""

    def __init__(self, future: Future[MaskResult], stats: MaskStats):
        self._future = future
        self._stats = stats
        self._result: MaskResult | None = None

    def result(self) -> MaskResult:
        if self._result is None:
            start = time.perf_counter()
            result = self._future.result()
            self._stats.wait_seconds += time.perf_counter() - start
            self._stats.rows_masked += result.masks.rows.numel()
            self._stats.mask_seconds += result.seconds
            self._result = result
        return self._result

    def wait(self) -> None:
        """Join without raising (a failed step must not leave the worker using its cursors)."""
        with contextlib.suppress(Exception):  # the step is failing for another reason already
            self.result()


class MaskComputer:
    """Computes a step's masks in one llguidance call; owns the llguidance executor and the worker thread."""

    def __init__(self, num_threads: int | None = None):
        self.num_threads = available_cpus() if num_threads is None else num_threads
        self.stats = MaskStats()
        self._executor: llguidance.LLExecutor | None = None  # built on first use: most engines never guide
        self._worker: ThreadPoolExecutor | None = None

    def compute(self, rows: Sequence[MaskRow]) -> MaskResult:
        """The masks of ``rows`` now, on this thread (the static path), accounted in :attr:`stats`."""
        future: Future[MaskResult] = Future()
        future.set_result(self._compute(list(rows)))
        return PendingMasks(future, self.stats).result()

    def submit(self, rows: Sequence[MaskRow]) -> PendingMasks:
        """Start computing the masks of ``rows`` on the worker thread; the cursors must not change until
        the returned handle is joined."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedgen-masks")
        return PendingMasks(self._worker.submit(self._compute, list(rows)), self.stats)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _compute(self, rows: list[MaskRow]) -> MaskResult:
        start = time.perf_counter()
        words = bitmask_words(max((r.cursor.vocab_size for r in rows), default=0))
        total = sum(len(r.drafts) + 1 for r in rows)
        bitmask = torch.full((total, words), -1, dtype=torch.int32)  # [G, W], all allowed until written
        logits_rows: list[int] = []
        entries: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        failed: list[tuple[int, GuidanceError]] = []
        for r in rows:
            try:
                entries.append((r.cursor.matcher, len(logits_rows), list(r.drafts)))
            except GuidanceError as error:  # poisoned earlier: no mask, the request fails
                failed.append((r.request_id, error))
            logits_rows.extend(range(r.row, r.row + len(r.drafts) + 1))
        if entries:
            executor = self._llg_executor()
            if any(drafts for _, _, drafts in entries):
                executor.unsafe_compute_mask_ptr_with_draft_token(
                    entries, bitmask.data_ptr(), words * 4, total
                )
            else:
                plain = [(matcher, at) for matcher, at, _ in entries]
                executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, total)
        reported = {rid for rid, _ in failed}
        for r in rows:
            if r.request_id not in reported:
                try:
                    r.cursor.check()
                except GuidanceError as error:
                    failed.append((r.request_id, error))
        masks = TokenMasks(torch.tensor(logits_rows, dtype=torch.long), bitmask)
        return MaskResult(masks, failed, time.perf_counter() - start)

    def _llg_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
        return self._executor
