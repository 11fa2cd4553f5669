"""Gemma 2 and Gemma 3 (text) over packed paged steps: local (sliding-window) and global layers alternating.

Written like the papers: token embedding scaled by sqrt(hidden) -> N x (RMSNorm, attention, RMSNorm,
residual, RMSNorm, GELU-tanh gated MLP, RMSNorm, residual) -> final RMSNorm -> tied LM head -> optional
final soft-cap ``cap * tanh(logits / cap)``. Gemma's traits, each as transformers computes it:

* every RMSNorm scales by ``1 + weight``, in float32 (checkpoints store the offset from one);
* "sandwich" norms: the attention and MLP outputs are normed again before their residual adds;
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (``config.query_scale``), not by the head
  size; Gemma 2 soft-caps them (``config.attn_softcap``) before the softmax;
* the sliding-window layers (``config.windowed_layers``, "local") attend within ``config.sliding_window``;
  Gemma 3 rotates them with their own RoPE base (``config.local_rope``) while its global layers take the
  configured scaling (``config.rope``), and normalises each q/k head (``q_norm`` / ``k_norm``) before RoPE.

Module and parameter names follow HF's ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``, so a state dict loads
by name. Every layer keeps paged K/V (KV-spec layer ``i`` is decoder layer ``i``); the local layers keep
theirs in window rings when the engine gives the step rings, as Mistral's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.step_inputs import StepInputs
from pagedgen.models.config import ModelConfig
from pagedgen.models.llama import Embedding, Linear, RotaryEmbedding, _fuse_linears, _param
from pagedgen.ops.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from pagedgen.ops.layer_ops import apply_rotary_
from pagedgen.ops.linear import linear
from pagedgen.ops.qweight import QuantizedWeight


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``: squashes ``x`` into ``(-cap, cap)``, near-identity for small values."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight``, all in float32, then cast back (transformers' Gemma order)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over one layer's paged KV cache, with Gemma's scale and optional soft-cap."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.scale = (config.query_scale or d) ** -0.5
        self.softcap = config.attn_softcap
        bias = config.qkv_bias  # transformers' ``attention_bias`` covers o_proj too
        self.q_proj = Linear(hidden, self.num_heads * d, bias, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * d, bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, bias, dtype)
        self.o_proj = Linear(self.num_heads * d, hidden, bias, dtype)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.qkv: Linear | None = None  # set by fuse_projections() once the weights are loaded

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (views of one fused product when fused)."""
        tokens, d = x.shape[0], self.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv(x).split(
                [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=1
            )
        return q.reshape(tokens, -1, d), k.reshape(tokens, -1, d), v.reshape(tokens, -1, d)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        inputs: StepInputs,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Mutates ``k_cache``/``v_cache`` at the plan's slots; returns ``[T, hidden]``."""
        tokens = x.shape[0]
        q, k, v = self._project_qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)
        slots = inputs.slot_mapping if plan.slot_mapping is None else plan.slot_mapping  # a ring's own
        write_kv(k, v, k_cache, v_cache, slots)
        out = paged_attention(q, k_cache, v_cache, inputs, self.scale, plan, softcap=self.softcap)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """GELU-tanh gated MLP: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(hidden, inner, False, dtype)
        self.up_proj = Linear(hidden, inner, False, dtype)
        self.down_proj = Linear(inner, hidden, False, dtype)
        self.gate_up: Linear | None = None  # set by fuse_projections() once the weights are loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


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
        rope: tuple[torch.Tensor, torch.Tensor],
        inputs: StepInputs,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, inputs, plan, k_cache, v_cache)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


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


class GemmaForCausalLM(nn.Module):
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
        self.vocab_size = config.vocab_size
        self.model = GemmaModel(config, dtype, device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )
        self.fused_decoder = None  # the fused native decode path is for plain Llama layers only

    def fuse_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up per layer (the parts become views; names stay valid)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up = _fuse_linears([mlp.gate_proj, mlp.up_proj])

    @property
    def head_weight(self) -> torch.Tensor | QuantizedWeight:
        """``[vocab, hidden]``: the LM head, or the token embedding when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

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
        for layer, k_cache, v_cache in zip(model.layers, kv_cache.keys, kv_cache.values, strict=True):
            if layer.local:
                x = layer(x, local_rope, inputs, window_plan, k_cache, v_cache)
            else:
                x = layer(x, rope, inputs, plan, k_cache, v_cache)
        x = model.norm(x[inputs.logits_rows])  # [R, hidden]
        return soft_cap(linear(x, self.head_weight), self.config.final_softcap).float()  # [R, vocab]
