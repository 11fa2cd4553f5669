"""Gemma 2 and Gemma 3 (text) over packed paged steps: local (sliding-window) and global layers alternating.

Written like the papers with HF's module names (a state dict loads by name), each Gemma trait as
transformers computes it; on float32 CPU activations a pure decode runs every layer in one native call with
the same bits. The traits and the state: docs/models.md, "Gemma 2 and Gemma 3".
"""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.step_inputs import StepInputs
from pagedgen.models.config import ModelConfig
from pagedgen.models.llama import MLP as LlamaMLP
from pagedgen.models.llama import Attention as LlamaAttention
from pagedgen.models.llama import (
    Embedding,
    RMSNorm,
    RotaryEmbedding,
    TiedHead,
    decoder_dims,
    fused_layer_parts,
    logits_rows_of,
)
from pagedgen.ops.layers.decoder_layers import FusedDecoder, LayerWeights
from pagedgen.ops.layers.layer_ops import Activation, add_rms_norm, gated_activation, rms_norm
from pagedgen.ops.mixers.attention import AttentionPlan, plan_attention


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``: squashes ``x`` into ``(-cap, cap)``, near-identity for small values."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight``, all in float32, then cast back (transformers' Gemma order).

    Llama's parameters (``weight``, ``eps``); only the scaling differs. On float32 CPU tensors it is the
    native RMSNorm with ``1 + weight`` as its weight (formed by :meth:`fold` once the weights are loaded,
    else per call), the one the fused decode path runs; elsewhere transformers' formula.
    """

    scale: torch.Tensor | None = None  # 1 + weight in float32, set by fold()

    def fold(self) -> None:
        """Form ``1 + weight`` once (after the weights are assigned; the model's fuse step calls it)."""
        self.scale = (1.0 + self.weight.float()).contiguous()

    @property
    def native_weight(self) -> torch.Tensor:
        return self.scale if self.scale is not None else (1.0 + self.weight.float()).contiguous()

    def _native(self, x: torch.Tensor) -> bool:
        return x.dtype is torch.float32 and x.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return rms_norm(x, self.native_weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._native(residual):
            return add_rms_norm(residual, delta, self.native_weight, self.eps)
        residual = residual + delta
        return residual, self(residual)


class Attention(LlamaAttention):
    """Llama's grouped-query attention with Gemma's query scale, optional soft-cap, ``o_proj`` bias and
    ``1 + weight`` q/k norms (the projections, their fusion and the forward are Llama's)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__(
            config,
            dtype,
            query_scale=config.query_scale,
            o_bias=config.qkv_bias,  # transformers' ``attention_bias`` covers o_proj too
            norm=GemmaRMSNorm,
        )
        self.softcap = config.attn_softcap


class MLP(LlamaMLP):
    """GELU-tanh gated MLP, no biases: ``down(gelu_tanh(gate(x)) * up(x))``; Llama's but the activation."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__(config, dtype, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(gated_activation(gate, up, Activation.GELU_TANH))


class DecoderLayer(nn.Module):
    """Sandwich-norm block: ``x + norm(attn(norm(x)))`` then ``x + norm(mlp(norm(x)))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, local: bool):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.local = local  # a sliding-window layer: the window plan and the local RoPE
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = MLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        inputs: StepInputs,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like Llama's layer: ``x`` still misses ``delta`` (the previous layer's normed MLP output,
        ``None`` before the first layer); returns the stream and this layer's, likewise unadded, so each
        residual add is fused into the norm after it."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, delta)
        h = self.self_attn(h, rope, inputs, plan, k_cache, v_cache)
        x, h = self.pre_feedforward_layernorm.add_forward(x, self.post_attention_layernorm(h))
        return x, self.post_feedforward_layernorm(self.mlp(h))


class GemmaModel(nn.Module):
    """The decoder trunk (``model.*`` in HF checkpoints)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        local = set(config.windowed_layers)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, i in local) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, device)
        self.rotary_emb_local = (
            None if config.local_rope is None else RotaryEmbedding(config.local_rope, config.head_dim, device)
        )


class GemmaForCausalLM(TiedHead, nn.Module):
    """A :class:`pagedgen.models.base.CausalLM` for Gemma 2 and Gemma 3 text: one forward per packed step."""

    fixed_state_specs: tuple = ()  # every layer attends: paged K/V only

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if "freq_factors" in (config.rope.rope_type, getattr(config.local_rope, "rope_type", None)):
            raise ValueError("a Gemma runtime takes no rope freq_factors weight (a llama.cpp Llama 3 trait)")
        self.config = config
        self.dtype = dtype
        self.kv_spec = KVSpec(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            window_size=config.sliding_window,
            window_layers=config.windowed_layers,
        )
        self.model = GemmaModel(config, dtype, device)
        self._init_head(config, dtype)
        self.fused_decoder: FusedDecoder | None = None  # set by fuse_projections() when it can run

    def fuse_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up per layer (the parts become views; names stay valid), every
        norm's ``1 + weight`` formed once, and the one-call decode path built when the weights allow it."""
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.fold()
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            layer.mlp.fuse_gate_up()
        self.fused_decoder = self._build_fused_decoder()

    def _build_fused_decoder(self) -> FusedDecoder | None:
        """``None`` for soft-capped attention scores (not in the fused kernel), other dtypes, or a projection
        not kept in a stored format."""
        if self.dtype is not torch.float32 or self.config.attn_softcap is not None:
            return None
        local_rope = self.model.rotary_emb_local is not None
        layers = []
        for layer in self.model.layers:
            parts = fused_layer_parts(layer.self_attn, layer.mlp)
            if parts is None:
                return None
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.native_weight,
                    post_norm=layer.pre_feedforward_layernorm.native_weight,
                    attn_out_norm=layer.post_attention_layernorm.native_weight,
                    mlp_out_norm=layer.post_feedforward_layernorm.native_weight,
                    down=layer.mlp.down_proj.weight,
                    down_bias=layer.mlp.down_proj.bias,
                    windowed=layer.local,
                    local_rope=layer.local and local_rope,
                    **parts,
                )
            )
        dims = decoder_dims(self.config, self.model.layers[0].self_attn, Activation.GELU_TANH)
        return FusedDecoder.build(layers, dims)

    def _plans(
        self, inputs: StepInputs, kv_cache: PagedKVCache
    ) -> tuple[AttentionPlan, AttentionPlan | None]:
        """The global layers' plan and the local layers' window plan, once per step.

        With soft-capped scores every row takes the torch path, so the plans skip the native kernel (and
        build the torch decode buckets once, not once per layer).
        """
        native = self.config.attn_softcap is None
        plan = plan_attention(inputs, kv_cache.keys[0], use_native=native)
        local = [i for i, layer in enumerate(self.model.layers) if layer.local]
        if not local:
            return plan, None
        window = self.config.sliding_window
        return plan, plan_attention(inputs, kv_cache.keys[local[0]], use_native=native, window=window)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_cache: PagedKVCache) -> torch.Tensor:
        """Float32 logits ``[len(inputs.logits_rows), vocab]``; mutates ``kv_cache`` at the step's slots."""
        if len(kv_cache.keys) != len(self.model.layers):
            raise ValueError(f"kv_cache has {len(kv_cache.keys)} layers, the model {len(self.model.layers)}")
        model = self.model
        x = model.embed_tokens(inputs.input_ids)  # [T, hidden]
        x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)  # fp32, then the dtype: as HF rounds
        rope = model.rotary_emb(inputs.positions, x.dtype)  # 2 x [T, head_dim]
        local_rope = (
            rope if model.rotary_emb_local is None else model.rotary_emb_local(inputs.positions, x.dtype)
        )
        plan, window_plan = self._plans(inputs, kv_cache)
        fused = self.fused_decoder
        if fused is not None and fused.supports(x, inputs, plan, window_plan):
            keys, values = kv_cache.keys, kv_cache.values
            x, delta = fused.run(x, rope, inputs, plan, keys, values, window_plan, local_rope)
        else:
            delta = None
            for layer, k_cache, v_cache in zip(model.layers, kv_cache.keys, kv_cache.values, strict=True):
                if layer.local:
                    x, delta = layer(x, delta, local_rope, inputs, window_plan, k_cache, v_cache)
                else:
                    x, delta = layer(x, delta, rope, inputs, plan, k_cache, v_cache)
        _, x = model.norm.add_forward(*logits_rows_of(x, delta, inputs))  # [R, hidden]: one native call
        return soft_cap(self._head(x), self.config.final_softcap).float()  # [R, vocab]
