"""Bamba (IBM) over packed paged steps: Mamba-2 mixer layers mixed with grouped-query attention.

Written like the paper (embedding, N x (norm, mixer, norm, SwiGLU MLP), norm, head), with HF's
``BambaForCausalLM`` names so a state dict loads by name; GraniteMoeHybrid with a dense MLP is the same
network under other names with Granite's multipliers. Attention layers keep paged K/V, each Mamba layer a
conv and an SSM state that the engine publishes only at commit. The mixer's equations, the Granite mapping
and the state layout: docs/models.md, "Bamba and GraniteMoeHybrid".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.core.fixed_state_spec import FixedStateSpec
from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.state_manifest import StateKind
from pagedgen.core.step_inputs import FixedStateInputs, StepInputs
from pagedgen.models.config import ModelConfig
from pagedgen.models.lfm2 import CausalConv1d
from pagedgen.models.llama import MLP, Embedding, Linear, RMSNorm, RotaryEmbedding, TiedHead, _param
from pagedgen.ops.layers.layer_ops import apply_rotary_, silu_and_mul
from pagedgen.ops.mixers.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from pagedgen.ops.mixers.conv import packed_causal_conv
from pagedgen.ops.mixers.ssm import packed_selective_scan


def conv_state_name(layer: int) -> str:
    return f"mamba_conv.{layer}"


def ssm_state_name(layer: int) -> str:
    return f"mamba_ssm.{layer}"


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))`` with the RMS taken per group of ``group_size`` channels (Mamba-2's
    norm before ``out_proj``; one group per B/C group), in float32."""

    def __init__(self, dim: int, group_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        tokens, dim = y.shape
        h = (y.float() * F.silu(gate.float())).view(tokens, -1, self.group_size)  # [T, G, dim / G]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(tokens, dim).to(self.weight.dtype)


class Mamba2Mixer(nn.Module):
    """Bamba's Mamba-2 block; its fixed state is the convolution's window and the SSM state."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden, inner, heads = config.hidden_size, config.mamba_inner, config.mamba_heads
        self.heads, self.head_dim = heads, config.mamba_head_dim
        self.groups, self.state_size = config.mamba_groups, config.mamba_state
        self.conv_dim = config.mamba_conv_dim
        self.time_step_limit = config.time_step_limit
        self.in_proj = Linear(hidden, inner + self.conv_dim + heads, config.mamba_proj_bias, dtype)
        self.conv1d = CausalConv1d(self.conv_dim, config.mamba_conv_kernel, config.mamba_conv_bias, dtype)
        self.dt_bias = _param(heads, dtype=dtype)
        self.A_log = _param(heads, dtype=dtype)
        self.D = _param(heads, dtype=dtype)
        self.norm = GatedRMSNorm(inner, inner // self.groups, config.rms_norm_eps, dtype)
        self.out_proj = Linear(inner, hidden, config.mamba_proj_bias, dtype)

    def forward(
        self,
        h: torch.Tensor,
        cu_seqlens: torch.Tensor,
        fixed: FixedStateInputs,
        layer: int,
        host_cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, hidden]``; writes the layer's conv window and SSM state after the step to fixed.outputs.
        ``host_cu_seqlens`` (the host copy of ``cu_seqlens``) lets the scan plan its chunks without reading
        the device."""
        tokens, inner = h.shape[0], self.heads * self.head_dim
        gate, xbc, dt = self.in_proj(h).split([inner, self.conv_dim, self.heads], dim=-1)
        conv, ssm = conv_state_name(layer), ssm_state_name(layer)
        xbc = packed_causal_conv(
            xbc,
            self.conv1d.weight[:, 0],
            self.conv1d.bias,
            cu_seqlens,
            fixed.inputs[conv],
            fixed.outputs[conv],
        )
        x, b, c = F.silu(xbc).split(
            [inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1
        )
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)  # [T, heads]
        x = x.reshape(tokens, self.heads, self.head_dim)
        y = packed_selective_scan(
            x,
            dt,
            -torch.exp(self.A_log.float()),
            b.reshape(tokens, self.groups, self.state_size),
            c.reshape(tokens, self.groups, self.state_size),
            cu_seqlens,
            fixed.inputs[ssm],
            fixed.outputs[ssm],
            host_cu_seqlens=host_cu_seqlens,
        )  # [T, heads, head_dim] float32
        y = y + self.D.float()[:, None] * x.float()  # the D skip connection
        return self.out_proj(self.norm(y.view(tokens, inner), gate).to(h.dtype))


class Attention(nn.Module):
    """Grouped-query attention over one layer's paged KV cache; RoPE rotates the first ``rotary_dim`` dims
    of each head and passes the rest through (Bamba: half)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden, d, bias = config.hidden_size, config.head_dim, config.qkv_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.rotary_dim = config.rotary_dim
        self.scale = d**-0.5 if config.attention_scale is None else config.attention_scale
        self.q_proj = Linear(hidden, self.num_heads * d, bias, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * d, bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, bias, dtype)
        self.o_proj = Linear(self.num_heads * d, hidden, bias, dtype)  # Bamba biases o_proj too

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        inputs: StepInputs,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Mutates ``k_cache``/``v_cache`` at the step's slots; returns ``[T, hidden]``. ``rope`` is None for
        attention without positional encoding."""
        tokens, d, rot = x.shape[0], self.head_dim, self.rotary_dim
        q = self.q_proj(x).view(tokens, -1, d)  # [T, Hq, D]
        k = self.k_proj(x).view(tokens, -1, d)  # [T, Hkv, D]
        v = self.v_proj(x).view(tokens, -1, d)
        if rope is not None:
            cos, sin = rope  # [T, rot]
            apply_rotary_(q[..., :rot], cos, sin)  # in place on the rotated dims
            apply_rotary_(k[..., :rot], cos, sin)
        write_kv(k, v, k_cache, v_cache, inputs.slot_mapping, plan.host_slot_mapping)
        out = paged_attention(q, k_cache, v_cache, inputs, self.scale, plan)  # [T, Hq, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * d))


class SharedMLP(nn.Module):
    """GraniteMoeHybrid's dense MLP: ``output_linear(silu(gate) * up)`` with gate and up stacked in
    ``input_linear`` (gate first)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.input_linear = Linear(hidden, 2 * inner, False, dtype)
        self.output_linear = Linear(inner, hidden, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(silu_and_mul(self.input_linear(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is attention or Mamba-2.

    The MLP and its norm carry the checkpoint's names: Bamba's ``pre_ff_layernorm`` / ``feed_forward``, or
    GraniteMoeHybrid's ``post_attention_layernorm`` / ``shared_mlp``.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, is_attention: bool):
        super().__init__()
        self.is_attention = is_attention
        self.granite = config.architecture == "granitemoehybrid"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if is_attention:
            self.self_attn = Attention(config, dtype)
        else:
            self.mamba = Mamba2Mixer(config, dtype)
        if self.granite:
            self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.shared_mlp = SharedMLP(config, dtype)
        else:
            self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.feed_forward = MLP(config, dtype)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of the normed residual stream ``x [T, hidden]``."""
        if self.granite:
            return self.shared_mlp(self.post_attention_layernorm(x))
        return self.feed_forward(self.pre_ff_layernorm(x))


class BambaModel(nn.Module):
    """The decoder trunk (``model.*`` in HF checkpoints; the final norm is Granite's ``norm``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        mamba = set(config.mamba_layers)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, i not in mamba) for i in range(config.num_layers)
        )
        self.granite = config.architecture == "granitemoehybrid"
        final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if self.granite:
            self.norm = final_norm
        else:
            self.final_layernorm = final_norm
        self.rotary_emb = (
            RotaryEmbedding(config.rope, config.rotary_dim, device) if config.rotary_dim else None
        )

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.granite else self.final_layernorm(x)


def fixed_state_specs(config: ModelConfig, dtype: torch.dtype) -> tuple[FixedStateSpec, ...]:
    """Per Mamba layer its conv window (fixed_conv, model dtype) and SSM state (fixed_recurrent, float32)."""
    specs = []
    for i in config.mamba_layers:
        window = (config.mamba_conv_kernel - 1, config.mamba_conv_dim)
        ssm = (config.mamba_heads, config.mamba_head_dim, config.mamba_state)
        specs.append(FixedStateSpec(conv_state_name(i), StateKind.FIXED_CONV, i, window, dtype))
        specs.append(FixedStateSpec(ssm_state_name(i), StateKind.FIXED_RECURRENT, i, ssm, torch.float32))
    return tuple(specs)


class BambaForCausalLM(TiedHead, nn.Module):
    """A :class:`pagedgen.models.base.CausalLM` with fixed conv and recurrent state: one forward per step."""

    fused_decoder = None  # the fused native decode path is for plain Llama layers only

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        attention = config.attention_layers
        if not attention or not config.mamba_layers:
            raise ValueError(
                f"a Bamba / GraniteMoeHybrid runtime needs an attention layer and a Mamba layer, got "
                f"attention layers {list(attention)} and Mamba layers {list(config.mamba_layers)}"
            )
        self.config = config
        self.dtype = dtype
        self.kv_spec = KVSpec(len(attention), config.num_kv_heads, config.head_dim, dtype)
        self.fixed_state_specs = fixed_state_specs(config, dtype)
        self.model = BambaModel(config, dtype, device)
        self._init_head(config, dtype)

    def fuse_projections(self) -> None:
        """One GEMM for each Bamba MLP's gate and up projections (Granite's are stored as one; the mixers and
        attention run as written)."""
        for layer in self.model.layers:
            if not layer.granite:
                layer.feed_forward.fuse_gate_up()

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_cache: PagedKVCache) -> torch.Tensor:
        """Float32 logits ``[len(inputs.logits_rows), vocab]``; mutates ``kv_cache`` at ``slot_mapping`` and
        writes every Mamba layer's conv window and SSM state after the step into ``inputs.fixed.outputs``."""
        if len(kv_cache.keys) != self.kv_spec.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache.keys)} layers, the model {self.kv_spec.num_layers}")
        fixed = inputs.fixed
        if fixed is None:
            raise ValueError("a Bamba step needs its fixed conv / recurrent state bindings (inputs.fixed)")
        config = self.config
        x = self.model.embed_tokens(inputs.input_ids) * config.embedding_multiplier  # [T, hidden]
        rotary = self.model.rotary_emb
        rope = None if rotary is None else rotary(inputs.positions, x.dtype)  # 2 x [T, rotary_dim]
        plan = plan_attention(inputs, kv_cache.keys[0])  # once per step, shared by every attention layer
        caches = iter(zip(kv_cache.keys, kv_cache.values, strict=True))
        for i, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            if layer.is_attention:
                k_cache, v_cache = next(caches)
                h = layer.self_attn(h, rope, inputs, plan, k_cache, v_cache)
            else:
                host_cu = None if inputs.host is None else inputs.host.cu_seqlens
                h = layer.mamba(h, inputs.cu_seqlens, fixed, i, host_cu)
            x = x + h * config.residual_multiplier
            x = x + layer.mlp(x) * config.residual_multiplier
        x = self.model.final_norm(x[inputs.logits_rows])  # [R, hidden]
        return self._head(x).float() / config.logits_scaling  # [R, vocab]
