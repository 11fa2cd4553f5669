"""One rank's slice of a loaded Llama-family runtime (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

Megatron's split, done once after loading: q/k/v and gate/up are column-parallel (each rank keeps the
output rows of its heads and inner channels, :mod:`pagedgen.parallel.plan`), o and down row-parallel (each
rank keeps the matching input columns and sums its partial product with the others' in one all-reduce;
their biases are added on rank 0 only). The embedding, the norms and the LM head are replicated, so after
each all-reduce every rank holds the same residual stream. The result is an ordinary
:class:`LlamaForCausalLM` of the local sizes: its attention, its KV spec (only its KV heads) and its forward
are the single-rank code, unchanged.

Weights kept in a stored quant format are cut on block boundaries and keep their kernels: rows are whole
rows, and a column cut falls on a block edge whenever the cut (a multiple of the head size, or of the down
projection's block) is one. A column cut inside a block (a 64-wide head range of a 256-element K-quant
row) expands that one slice to float32 instead, exactly (``dequantize_column_cuts`` counts them).

The fused decode path (:mod:`pagedgen.ops.layers.decoder_layers`, every layer in one native call) has no point
between o and the residual add for the all-reduce, so a sharded runtime runs its layers one by one (the
per-layer path, the same arithmetic; its cost is measured in docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from pagedgen.models.llama import DecoderLayer, Linear, LlamaForCausalLM, _set_weight
from pagedgen.ops.matmul.linear import linear
from pagedgen.ops.matmul.quant_gemm import dequantize
from pagedgen.ops.matmul.qweight import QuantizedWeight
from pagedgen.parallel.plan import RankShard, TensorParallelError, plan_shards

Weight = torch.Tensor | QuantizedWeight
AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks, in place; returns it

LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class RowParallelLinear(Linear):
    """``all_reduce(x W_r^T (+ b on rank 0))``: a row-parallel projection's local product, summed."""

    def __init__(self, part: Linear, reduce: AllReduce):
        nn.Module.__init__(self)
        _set_weight(self, part.weight)
        self.bias = part.bias
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(linear(x, self.weight, self.bias).contiguous())


@dataclass(slots=True)
class ShardReport:
    """What cutting one rank's weights did: ``dequantized`` slices went to float32 (cuts inside a block)."""

    dequantized: int = 0


def check_family(runtime: object, architecture: str, world: int) -> None:
    """Refuse ``world > 1`` for anything but the Llama family's runtime, naming the family."""
    if world > 1 and (type(runtime) is not LlamaForCausalLM or architecture not in LLAMA_FAMILIES):
        raise TensorParallelError(
            f"tensor_parallel_size={world} is implemented for the Llama family "
            f"({', '.join(LLAMA_FAMILIES)}); this model's family is {architecture!r}"
        )


def plan_for(runtime: LlamaForCausalLM, world: int) -> list[RankShard]:
    """The shards of ``runtime`` over ``world`` ranks (the down projection's block decides the MLP unit)."""
    config = runtime.config
    down = runtime.model.layers[0].mlp.down_proj.weight
    unit = down.qtype.block_elems if isinstance(down, QuantizedWeight) else 1
    return plan_shards(config.num_heads, config.num_kv_heads, config.intermediate_size, world, unit)


def _rows(weight: Weight, start: int, end: int) -> Weight:
    """Output rows ``start:end``, copied (a worker then frees the full checkpoint)."""
    if isinstance(weight, QuantizedWeight):
        part = weight.rows(start, end)
        return replace(part, data=part.data.clone())
    return weight[start:end].clone()


def _columns(weight: Weight, start: int, end: int, report: ShardReport) -> Weight:
    """Input columns ``start:end``: whole blocks of a stored weight, else that slice in float32."""
    if not isinstance(weight, QuantizedWeight):
        return weight[:, start:end].contiguous()
    elems, nbytes = weight.qtype.block_elems, weight.qtype.block_bytes
    if start % elems or end % elems:
        report.dequantized += 1
        return dequantize(weight)[:, start:end].contiguous()
    data = weight.data[:, start // elems * nbytes : end // elems * nbytes].contiguous()
    return QuantizedWeight(weight.qtype, (weight.shape[0], end - start), data, weight.q8_activations)


def _bias_rows(bias: torch.Tensor | None, start: int, end: int) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias[start:end].clone(), requires_grad=False)


def _column_linear(target: Linear, source: Linear, start: int, end: int) -> None:
    _set_weight(target, _rows(source.weight, start, end))
    target.bias = _bias_rows(source.bias, start, end)


def _row_linear(
    target: Linear, source: Linear, start: int, end: int, shard: RankShard, report: ShardReport
) -> None:
    _set_weight(target, _columns(source.weight, start, end, report))
    target.bias = source.bias if shard.adds_bias else None


def _share(target: nn.Module, source: nn.Module) -> None:
    """A replicated weight: the same tensor (no copy)."""
    _set_weight(target, source.weight)


def _shard_layer(
    local: DecoderLayer, full: DecoderLayer, shard: RankShard, d: int, reduce: AllReduce, report: ShardReport
) -> None:
    _share(local.input_layernorm, full.input_layernorm)
    _share(local.post_attention_layernorm, full.post_attention_layernorm)
    attn, src = local.self_attn, full.self_attn
    (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
    _column_linear(attn.q_proj, src.q_proj, q0 * d, q1 * d)
    _column_linear(attn.k_proj, src.k_proj, k0 * d, k1 * d)
    _column_linear(attn.v_proj, src.v_proj, k0 * d, k1 * d)
    _row_linear(attn.o_proj, src.o_proj, q0 * d, q1 * d, shard, report)
    for norm, full_norm in ((attn.q_norm, src.q_norm), (attn.k_norm, src.k_norm)):
        if norm is not None and full_norm is not None:
            _share(norm, full_norm)
    mlp, src_mlp = local.mlp, full.mlp
    i0, i1 = shard.inner
    _column_linear(mlp.gate_proj, src_mlp.gate_proj, i0, i1)
    _column_linear(mlp.up_proj, src_mlp.up_proj, i0, i1)
    _row_linear(mlp.down_proj, src_mlp.down_proj, i0, i1, shard, report)
    attn.fuse_qkv()
    mlp.fuse_gate_up()
    attn.o_proj = RowParallelLinear(attn.o_proj, reduce)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, reduce)


def shard_llama(
    runtime: LlamaForCausalLM, shard: RankShard, reduce: AllReduce
) -> tuple[LlamaForCausalLM, ShardReport]:
    """A new runtime holding ``shard``'s slice of ``runtime`` (which is not changed); its row-parallel
    layers call ``reduce``. Raises :class:`TensorParallelError` for a runtime of another family."""
    config = runtime.config
    check_family(runtime, config.architecture, 2)
    local_config = replace(
        config,
        num_heads=shard.num_q_heads,
        num_kv_heads=shard.num_kv_heads,
        intermediate_size=shard.num_inner,
    )
    device = runtime.model.rotary_emb.inv_freq.device
    local = LlamaForCausalLM(local_config, runtime.dtype, device)
    full_model, model = runtime.model, local.model
    _share(model.embed_tokens, full_model.embed_tokens)
    _share(model.norm, full_model.norm)
    if runtime.lm_head is not None and local.lm_head is not None:
        _share(local.lm_head, runtime.lm_head)
    if full_model.rotary_emb.freq_factors is not None:
        model.rotary_emb.freq_factors = full_model.rotary_emb.freq_factors
    report = ShardReport()
    for layer, full_layer in zip(model.layers, full_model.layers, strict=True):
        _shard_layer(layer, full_layer, shard, config.head_dim, reduce, report)
    local.fused_decoder = None  # the per-layer path: the all-reduce sits inside each layer
    return local.eval(), report


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s weights (parameters and stored-format weights), each byte counted once
    (views of one fused tensor overlap; replicated weights may be views into a larger file mapping)."""
    spans = []
    for sub in module.modules():
        for value in (*sub._parameters.values(), sub.__dict__.get("weight")):
            tensor = value.data if isinstance(value, QuantizedWeight) else value
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                start = tensor.data_ptr()
                spans.append((start, start + tensor.numel() * tensor.element_size()))
    total, reach = 0, 0
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
