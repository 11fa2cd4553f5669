"""The engine's collaborators, built in one place from a model and a config and handed to ``Engine``.

``Engine`` owns requests, events and health; everything else (the cache layout and manager, the scheduler, the
step, the model runner, the failure isolator, the fault injector) is a part it is given. Building them here
keeps ``Engine.__init__`` to bookkeeping and gives a test one supported way to swap a collaborator: pass its
own :class:`FaultInjector`, or wrap the runner or the cache manager in a spy, and hand the parts to
``pg.Engine(model, config, parts=parts)``. The roles the parts fill are the Protocols of
:mod:`pagedgen.engine.roles` (docs/architecture.md, "The engine's parts").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedgen.cache import FixedStatePool, PagedCacheManager, blocks_for_tokens
from pagedgen.core.decoder import DecoderModel
from pagedgen.engine.cache_layout import CacheLayout, plan_cache_layout
from pagedgen.engine.config import EngineConfig, resolve_mixed_step_tokens, resolve_num_blocks
from pagedgen.engine.faults import FaultInjector
from pagedgen.engine.isolation import FailureIsolator
from pagedgen.engine.roles import EngineScheduler, EngineStep
from pagedgen.engine.scheduler import AGE_LIMIT, DynamicScheduler
from pagedgen.engine.static import StaticScheduler, StaticStep
from pagedgen.engine.step import DynamicStep
from pagedgen.executor.runner import ModelRunner, StepRunner
from pagedgen.guidance.masks import MASK_BUDGET_S, MaskComputer

RunnerWrapper = Callable[[StepRunner], StepRunner]
CacheWrapper = Callable[[PagedCacheManager], PagedCacheManager]


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What one engine runs on. ``cache`` is the dynamic path's manager (None on the static path, whose
    scheduler keeps its batch's blocks itself); ``model`` and ``config`` are what the parts were built for."""

    model: DecoderModel
    config: EngineConfig
    layout: CacheLayout
    num_blocks: int
    runner: StepRunner
    cache: PagedCacheManager | None
    scheduler: EngineScheduler
    step: EngineStep
    isolator: FailureIsolator
    faults: FaultInjector


def build_engine_parts(
    model: DecoderModel,
    config: EngineConfig,
    *,
    faults: FaultInjector | None = None,
    wrap_runner: RunnerWrapper | None = None,
    wrap_cache: CacheWrapper | None = None,
    age_limit: int = AGE_LIMIT,
    mask_budget_s: float = MASK_BUDGET_S,
) -> EngineParts:
    """The parts ``Engine(model, config)`` runs on.

    ``faults`` is the injector every phase checks (a fresh, unarmed one by default); ``wrap_runner`` and
    ``wrap_cache`` receive the built runner / cache manager and return what the step and the scheduler use
    instead (a spy that records and delegates); ``age_limit`` is the scheduler's deferrals before a waiting
    turn goes first; ``mask_budget_s`` how long sampling waits for a guided row's mask. Raises
    :class:`~pagedgen.errors.UnsupportedStateError` for a model whose state this engine cannot serve.
    """
    faults = FaultInjector() if faults is None else faults
    device = torch.device(model.device)
    layout = plan_cache_layout(model, config)  # the manifest decides the cache paths
    num_blocks = resolve_num_blocks(
        config,
        layout.bytes_per_block,
        int(model.max_context),
        device,
        layout.window_bytes + layout.fixed_bytes,
    )
    runner = _runner(model, config, layout, num_blocks)
    runner.adapt_gemm(config.max_batch_size, config.max_scheduled_tokens, layout.chunk_size)
    if wrap_runner is not None:
        runner = wrap_runner(runner)
    isolator = FailureIsolator(config.max_step_retries)
    eos = tuple(model.eos_token_ids)
    if not config.dynamic_batching:
        static = StaticScheduler(num_blocks, config.block_size, config.max_batch_size)
        masker = MaskComputer(budget_s=mask_budget_s)
        step = StaticStep(static, runner, faults, eos, isolator, masker)
        return EngineParts(model, config, layout, num_blocks, runner, None, static, step, isolator, faults)
    cache = _cache(model, config, layout, num_blocks, device)
    if wrap_cache is not None:
        cache = wrap_cache(cache)
    scheduler = DynamicScheduler(
        cache,
        config.max_batch_size,
        config.max_scheduled_tokens,
        layout.chunk_size,
        max_draft_tokens=0 if cache.fixed is not None else config.max_draft_tokens,
        max_mixed_step_tokens=resolve_mixed_step_tokens(config, device),
        age_limit=age_limit,
    )
    masker = MaskComputer(budget_s=mask_budget_s, hold=faults.hold_mask)
    step = DynamicStep(scheduler, runner, faults, eos, isolator, masker)
    return EngineParts(model, config, layout, num_blocks, runner, cache, scheduler, step, isolator, faults)


def _runner(model: DecoderModel, config: EngineConfig, layout: CacheLayout, num_blocks: int) -> StepRunner:
    window_blocks = None if layout.window is None else layout.window.num_blocks
    if config.tensor_parallel_size > 1:
        from pagedgen.parallel.runner import TensorParallelRunner

        return TensorParallelRunner(
            model,
            config.tensor_parallel_size,
            num_blocks,
            config.block_size,
            window_blocks,
            launcher=config.tensor_parallel_launcher,
            placement=config.tensor_parallel_placement,
        )
    return ModelRunner(
        model,
        num_blocks,
        config.block_size,
        window_blocks,
        cuda_graphs=config.cuda_graphs,
        max_batch_size=config.max_batch_size,
    )


def _cache(
    model: DecoderModel, config: EngineConfig, layout: CacheLayout, num_blocks: int, device: torch.device
) -> PagedCacheManager:
    fixed = FixedStatePool(layout.fixed, config.max_batch_size, device) if layout.fixed else None
    return PagedCacheManager(
        num_blocks,
        config.block_size,
        config.max_batch_size,
        max_blocks_per_table=blocks_for_tokens(int(model.max_context), config.block_size),
        window=layout.window,
        fixed=fixed,
        prefix_caching=layout.prefix_caching,
    )
