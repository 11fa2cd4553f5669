"""LFM2 (Liquid AI) over packed paged steps: gated short convolutions mixed with grouped-query attention.

Written like the paper with HF's ``Lfm2ForCausalLM`` names; attention layers keep paged K/V and each conv
layer its convolution window as fixed state that the engine publishes only at commit. The operator and the
state: docs/models.md, "LFM2".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.core.fixed_state_spec import FixedStateSpec
from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.state_manifest import StateKind
from pagedgen.core.step_inputs import StepInputs
from pagedgen.models.config import ModelConfig
from pagedgen.models.llama import Embedding, Linear, RMSNorm, RotaryEmbedding, TiedHead, _param
from pagedgen.ops.layers.layer_ops import apply_rotary_
from pagedgen.ops.mixers.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from pagedgen.ops.mixers.conv import packed_causal_conv


def conv_state_name(layer: int) -> str:
    return f"conv.{layer}"


class CausalConv1d(nn.Module):
    """The depthwise convolution's parameters (HF ``nn.Conv1d`` names): ``weight [C, 1, L]``, ``bias [C]``."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(channels, 1, kernel, dtype=dtype)
        self.bias = _param(channels, dtype=dtype) if bias else None


class ShortConv(nn.Module):
    """LFM2's gated short convolution; its fixed state is the convolution's last ``L - 1`` inputs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.in_proj = Linear(hidden, 3 * hidden, config.conv_bias, dtype)
        self.out_proj = Linear(hidden, hidden, config.conv_bias, dtype)
        self.conv = CausalConv1d(hidden, config.conv_kernel, config.conv_bias, dtype)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, state_in: torch.Tensor, state_out: torch.Tensor
    ) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # 3 x [T, hidden]
        y = packed_causal_conv(b * h, self.conv.weight[:, 0], self.conv.bias, cu_seqlens, state_in, state_out)
        return self.out_proj(c * y)


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm over one layer's paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.scale = d**-0.5
        self.q_proj = Linear(hidden, self.num_heads * d, False, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * d, False, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, False, dtype)
        self.out_proj = Linear(self.num_heads * d, hidden, False, dtype)
        self.q_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)
        self.k_layernorm = RMSNorm(d, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        inputs: StepInputs,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Mutates ``k_cache``/``v_cache`` at the step's slots; returns ``[T, hidden]``."""
        tokens, d = x.shape[0], self.head_dim
        q = self.q_layernorm(self.q_proj(x).view(tokens, -1, d))  # [T, Hq, D]
        k = self.k_layernorm(self.k_proj(x).view(tokens, -1, d))  # [T, Hkv, D]
        v = self.v_proj(x).view(tokens, -1, d)
        cos, sin = rope
        q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)
        write_kv(k, v, k_cache, v_cache, inputs.slot_mapping, plan.host_slot_mapping)
        out = paged_attention(q, k_cache, v_cache, inputs, self.scale, plan)  # [T, Hq, D]
        return self.out_proj(out.reshape(tokens, self.num_heads * d))


class MLP(nn.Module):
    """SwiGLU with LFM2's names: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.w1 = Linear(hidden, inner, False, dtype)
        self.w3 = Linear(hidden, inner, False, dtype)
        self.w2 = Linear(inner, hidden, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + operator(norm(x))`` then ``x + mlp(norm(x))``; the operator is attention or a
    short convolution."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, is_attention: bool):
        super().__init__()
        self.is_attention = is_attention
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if is_attention:
            self.self_attn = Attention(config, dtype)
        else:
            self.conv = ShortConv(config, dtype)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.feed_forward = MLP(config, dtype)


class Lfm2Model(nn.Module):
    """The decoder trunk (``model.*`` in HF checkpoints)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        conv = set(config.conv_layers)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, i not in conv) for i in range(config.num_layers)
        )
        self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)  # the final norm
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, device)


class Lfm2ForCausalLM(TiedHead, nn.Module):
    """A :class:`pagedgen.models.base.CausalLM` with fixed conv state: one forward per packed engine step."""

    fused_decoder = None  # the fused native decode path is for plain Llama layers only

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        attention = config.attention_layers
        if not attention or config.conv_kernel < 2:
            raise ValueError(
                f"an LFM2 runtime needs an attention layer and a convolution of >= 2 taps, got attention "
                f"layers {list(attention)} and conv_L_cache {config.conv_kernel}"
            )
        self.config = config
        self.dtype = dtype
        self.kv_spec = KVSpec(len(attention), config.num_kv_heads, config.head_dim, dtype)
        self.fixed_state_specs = tuple(
            FixedStateSpec(
                conv_state_name(i),
                StateKind.FIXED_CONV,
                i,
                (config.conv_kernel - 1, config.hidden_size),
                dtype,
            )
            for i in config.conv_layers
        )
        self.model = Lfm2Model(config, dtype, device)
        self._init_head(config, dtype)

    def fuse_projections(self) -> None:
        """Nothing to fuse: LFM2's layers run as written (the fused decode path is Llama's)."""

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_cache: PagedKVCache) -> torch.Tensor:
        """Float32 logits ``[len(inputs.logits_rows), vocab]``; mutates ``kv_cache`` at ``slot_mapping`` and
        writes every conv layer's state after the step into ``inputs.fixed.outputs``."""
        if len(kv_cache.keys) != self.kv_spec.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache.keys)} layers, the model {self.kv_spec.num_layers}")
        fixed = inputs.fixed
        if fixed is None:
            raise ValueError("an LFM2 step needs its fixed conv state bindings (inputs.fixed)")
        x = self.model.embed_tokens(inputs.input_ids)  # [T, hidden]
        rope = self.model.rotary_emb(inputs.positions, x.dtype)  # 2 x [T, head_dim]
        plan = plan_attention(inputs, kv_cache.keys[0])  # once per step, shared by every attention layer
        caches = iter(zip(kv_cache.keys, kv_cache.values, strict=True))
        for i, layer in enumerate(self.model.layers):
            h = layer.operator_norm(x)
            if layer.is_attention:
                k_cache, v_cache = next(caches)
                h = layer.self_attn(h, rope, inputs, plan, k_cache, v_cache)
            else:
                name = conv_state_name(i)
                h = layer.conv(h, inputs.cu_seqlens, fixed.inputs[name], fixed.outputs[name])
            x = x + h
            x = x + layer.feed_forward(layer.ffn_norm(x))
        x = self.model.embedding_norm(x[inputs.logits_rows])  # [R, hidden]
        return self._head(x).float()  # [R, vocab]
