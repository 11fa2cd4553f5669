"""The step's token masks: one batched llguidance call for every guided row, overlapped with the forward.

Masks are computed on worker threads while the owner thread runs the model, each guided row its own task
so one costly grammar cannot hold its batch-mates', and sampling waits at most a budget for them. Draft rows,
failures and the budget: docs/engine.md, "Token masks and their step budget".
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field

import llguidance
import torch

from pagedgen.errors import GuidanceError
from pagedgen.guidance.bitmask import TokenMasks, bitmask_words
from pagedgen.guidance.cursor import GrammarCursor

MASK_BUDGET_S = 0.5  # how long sampling waits after the forward pass for a mask that is not done


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

    def account(self, result: MaskResult, waited: float) -> MaskResult:
        self.rows_masked += result.masks.rows.numel()
        self.mask_seconds += result.seconds
        self.wait_seconds += waited
        return result


class PendingMasks:
    """A submitted computation (one task per guided row); :meth:`result` joins it (once), waiting at most
    the budget for rows not done, and accounts for the wait."""

    def __init__(
        self,
        rows: list[MaskRow],
        tasks: list[Future[GuidanceError | None]],
        masks: TokenMasks,
        computer: MaskComputer,
    ):
        self._rows = rows
        self._tasks = tasks
        self._masks = masks
        self._computer = computer
        self._started = time.perf_counter()
        self._result: MaskResult | None = None

    def result(self) -> MaskResult:
        if self._result is None:
            start = time.perf_counter()
            done, _late = wait_for(self._tasks, timeout=self._computer.budget_s)
            failed: list[tuple[int, GuidanceError]] = []
            late = False
            for row, task in zip(self._rows, self._tasks, strict=True):
                error = _late_error(self._computer.budget_s) if task not in done else task.result()
                if task not in done:
                    late = True
                    reason = str(error).removeprefix("guidance failed: ")
                    row.cursor.poison(reason)  # its matcher is the pool's until the task ends
                if error is not None:
                    failed.append((row.request_id, error))
            if late:
                self._computer.abandon_pool()
            now = time.perf_counter()
            result = MaskResult(self._masks, failed, now - self._started)
            self._result = self._computer.stats.account(result, now - start)
        return self._result

    def wait(self) -> None:
        """Join without raising (a failed step must not leave the pool using its cursors; a row past its
        budget is abandoned, as in :meth:`result`)."""
        with contextlib.suppress(Exception):  # the step is failing for another reason already
            self.result()


def _late_error(budget_s: float) -> GuidanceError:
    return GuidanceError(
        f"guidance failed: the constraint's token mask was not ready within the step budget of {budget_s} s"
    )


class MaskComputer:
    """Computes a step's masks; owns the llguidance executor and the mask thread pool.

    ``hold`` (tests only, through the engine's fault injector) is called with a row's request id in its
    task before the mask is computed: a test makes one row's mask slow with it.
    """

    def __init__(
        self,
        num_threads: int | None = None,
        budget_s: float = MASK_BUDGET_S,
        hold: Callable[[int], None] | None = None,
    ):
        self.num_threads = available_cpus() if num_threads is None else num_threads
        self.budget_s = budget_s
        self.hold = hold
        self.stats = MaskStats()
        self.abandoned_pools = 0  # pools left to a task past its budget
        self._executor: llguidance.LLExecutor | None = None  # built on first use: most engines never guide
        self._worker: ThreadPoolExecutor | None = None

    def compute(self, rows: Sequence[MaskRow]) -> MaskResult:
        """The masks of ``rows`` now, on this thread (the static path: sampling waits for all of it)."""
        result = self._compute(list(rows))
        return self.stats.account(result, result.seconds)

    def submit(self, rows: Sequence[MaskRow]) -> PendingMasks:
        """Start computing the masks of ``rows`` on the pool, one task per row; the cursors must not change
        until the returned handle is joined."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(self.num_threads, thread_name_prefix="pagedgen-masks")
        rows = list(rows)
        bitmask, logits_rows, offsets = _allocate(rows)
        submit = self._worker.submit
        tasks = [submit(self._fill_row, row, at, bitmask) for row, at in zip(rows, offsets, strict=True)]
        return PendingMasks(rows, tasks, TokenMasks(logits_rows, bitmask), self)

    def abandon_pool(self) -> None:
        """Leave the pool to its late tasks (their threads end with them) and use a fresh one."""
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None
            self.abandoned_pools += 1

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _fill_row(self, row: MaskRow, at: int, bitmask: torch.Tensor) -> GuidanceError | None:
        """One row's masks into rows ``at..`` of ``bitmask``; the cursor's error, if it has one."""
        if self.hold is not None:
            self.hold(row.request_id)
        try:
            self._fill([(row.cursor.matcher, at, list(row.drafts))], bitmask)
            row.cursor.check()
        except GuidanceError as error:
            return error
        return None

    def _compute(self, rows: list[MaskRow]) -> MaskResult:
        start = time.perf_counter()
        bitmask, logits_rows, offsets = _allocate(rows)
        entries: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        failed: list[tuple[int, GuidanceError]] = []
        for r, at in zip(rows, offsets, strict=True):
            try:
                entries.append((r.cursor.matcher, at, list(r.drafts)))
            except GuidanceError as error:  # poisoned earlier: no mask, the request fails
                failed.append((r.request_id, error))
        self._fill(entries, bitmask)
        reported = {rid for rid, _ in failed}
        for r in rows:
            if r.request_id not in reported:
                try:
                    r.cursor.check()
                except GuidanceError as error:
                    failed.append((r.request_id, error))
        return MaskResult(TokenMasks(logits_rows, bitmask), failed, time.perf_counter() - start)

    def _fill(
        self, entries: list[tuple[llguidance.LLMatcher, int, list[int]]], bitmask: torch.Tensor
    ) -> None:
        """Write the entries' masks into ``bitmask``: one llguidance call for the rows without drafts and one
        for those with drafts (llguidance's draft call refuses an empty draft list)."""
        rows, words = bitmask.shape
        plain = [(matcher, at) for matcher, at, drafts in entries if not drafts]
        drafted = [entry for entry in entries if entry[2]]
        executor = self._llg_executor()
        if plain:
            executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, rows)
        if drafted:
            executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, rows)

    def _llg_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
        return self._executor


def _allocate(rows: list[MaskRow]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The pass-through bitmask of ``rows``, the logits row of each mask row, and each row's first mask
    row (a row with K drafts has K + 1)."""
    words = bitmask_words(max((r.cursor.vocab_size for r in rows), default=0))
    total = sum(len(r.drafts) + 1 for r in rows)
    bitmask = torch.full((total, words), -1, dtype=torch.int32)  # [G, W], all allowed until written
    logits_rows: list[int] = []
    offsets: list[int] = []
    for r in rows:
        offsets.append(len(logits_rows))
        logits_rows.extend(range(r.row, r.row + len(r.drafts) + 1))
    return bitmask, torch.tensor(logits_rows, dtype=torch.long), offsets  # [G] int64
