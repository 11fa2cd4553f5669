"""The Llama family over packed paged steps: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 and Qwen3.

Written like the paper: token embedding -> N x (RMSNorm, attention, residual, RMSNorm, SwiGLU MLP, residual)
-> final RMSNorm -> LM head. The members differ only in small traits carried by :class:`ModelConfig`:
q/k/v bias (Qwen2), RMSNorm of each q/k head before RoPE (Qwen3), RoPE frequency scaling (Llama 3),
tied embeddings (SmolLM2, small Qwens). Module and parameter names follow HF checkpoints, so a state dict
loads by name.

Each attention layer projects q/k/v for the step's flat tokens, rotates q/k at ``inputs.positions``, writes
the new K/V into its paged cache through ``inputs.slot_mapping`` and attends over each request's history
through ``inputs.block_tables``. The final norm and the head run only for ``inputs.logits_rows``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.core.kv import KVSpec, PagedKVCache
from pagedgen.core.step_inputs import StepInputs
from pagedgen.models.config import ModelConfig, RopeConfig
from pagedgen.ops.layers.decoder_layers import DecoderDims, FusedDecoder, LayerWeights
from pagedgen.ops.layers.layer_ops import (
    Activation,
    add_rms_norm,
    apply_rotary_,
    gated_activation,
    rms_norm,
    rms_norm_heads_,
    silu_and_mul,
)
from pagedgen.ops.matmul.linear import linear
from pagedgen.ops.matmul.quant_gemm import embedding
from pagedgen.ops.matmul.qweight import QuantizedWeight, concat_rows
from pagedgen.ops.mixers.attention import AttentionPlan, paged_attention, plan_attention, write_kv


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An unmaterialised parameter: the loader assigns the real tensor (no double allocation)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


def _set_weight(module: nn.Module, weight: torch.Tensor | QuantizedWeight) -> None:
    """Assign a tensor as a parameter, or a weight kept in its stored format as a plain attribute."""
    if isinstance(weight, QuantizedWeight):
        if "weight" in module._parameters:
            delattr(module, "weight")
        object.__setattr__(module, "weight", weight)
    else:
        module.weight = nn.Parameter(weight, requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b`` through :func:`pagedgen.ops.matmul.linear.linear`; ``weight`` is ``[out, in]`` (a
    tensor, or a :class:`QuantizedWeight` when the checkpoint's format is kept)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _fuse_linears(parts: list[Linear]) -> Linear | None:
    """A Linear whose weight (and bias) stacks ``parts``' by output; the parts become views of it.

    The state-dict names and the memory stay as they were: each part's parameter now points into the fused
    tensor, so no weight is held twice. ``None`` (nothing changed) when the parts are stored in different
    formats (a Q4_K_M file keeps v in Q6_K beside q/k in Q4_K): they then run as separate GEMMs.
    """
    weights = [p.weight for p in parts]
    if all(isinstance(w, QuantizedWeight) for w in weights):
        if len({w.qtype for w in weights}) > 1:
            return None
        weight = concat_rows(weights)  # [sum(out), in] blocks
    elif any(isinstance(w, QuantizedWeight) for w in weights):
        return None
    else:
        weight = torch.cat(weights)  # [sum(out), in]
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32  # of the meta placeholder
    fused = Linear(weight.shape[1], weight.shape[0], False, dtype)
    _set_weight(fused, weight)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    start = 0
    for part in parts:
        end = start + part.weight.shape[0]
        _set_weight(
            part, weight.rows(start, end) if isinstance(weight, QuantizedWeight) else weight[start:end]
        )
        if part.bias is not None:
            part.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
        start = end
    return fused


class Embedding(nn.Module):
    """Token embedding ``[vocab, hidden]``; also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(vocab_size, hidden, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return embedding(input_ids, self.weight)  # dequantises only the looked-up rows
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as the reference implementations do, then cast back."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + delta, norm(residual + delta))``; may add into ``residual`` in place."""
        return add_rms_norm(residual, delta, self.weight, self.eps)

    @property
    def native_weight(self) -> torch.Tensor:
        """What the native RMSNorm multiplies by (the fused decode path takes it): here the weight."""
        return self.weight

    def heads_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of each head of ``x [T, H, D]`` (q/k norms), in place where the native kernel can."""
        normed = rms_norm_heads_(x, self.native_weight, self.eps)
        return self(x) if normed is None else normed


def rope_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32) for the rope type, as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # [head_dim / 2]
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq  # "default"; "freq_factors" divides by a loaded weight at run time
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the step's absolute positions; ``freq_factors`` only for GGUF Llama 3 files."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device):
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # [head_dim]: the frequencies twice, as the rotate-half tables repeat them (see forward)
        self.register_buffer("inv_freq_twice", torch.cat((inv_freq, inv_freq)), persistent=False)
        self.freq_factors = (
            _param(head_dim // 2, dtype=torch.float32) if rope.rope_type == "freq_factors" else None
        )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, head_dim]`` in ``dtype``.

        The angles are ``position * inv_freq`` with the frequencies repeated over the two halves. Each is one
        float32 product whichever way the table is laid out, so multiplying by the repeated frequencies at
        once gives the bits of the half table concatenated with itself, in one torch op instead of two
        (``tests/unit/test_rotary_tables.py``); ``cos``/``sin`` then run over the same ``[T, head_dim]``.
        """
        if self.freq_factors is None:
            inv_freq = self.inv_freq_twice
        else:
            half = self.inv_freq / self.freq_factors
            inv_freq = torch.cat((half, half))
        emb = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache of one layer."""

    softcap: float | None = None  # scores squashed to ``softcap * tanh(s / softcap)`` first (Gemma 2)

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        *,
        query_scale: float | None = None,
        o_bias: bool = False,
        norm: type[nn.Module] = RMSNorm,
    ):
        """``query_scale``: what scores are scaled by the inverse square root of (the head size when
        ``None``); ``o_bias``: an ``o_proj`` bias; ``norm``: the q/k head norm's class. The variants
        (Gemma's) share the projections, the fusion and the forward; the names stay HF's."""
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.scale = (query_scale or d) ** -0.5
        self.q_proj = Linear(hidden, self.num_heads * d, config.qkv_bias, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * d, config.qkv_bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, config.qkv_bias, dtype)
        self.o_proj = Linear(self.num_heads * d, hidden, o_bias, dtype)
        self.q_norm = norm(d, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = norm(d, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.qkv: Linear | None = None  # set by fuse_qkv() once the weights are loaded

    def fuse_qkv(self) -> None:
        """Concatenate the q/k/v weights into one ``[q + 2 kv, hidden]`` matrix; q/k/v become views of it
        (left apart when stored in different formats).

        Why: one GEMM per layer instead of three, each big enough to split across threads
        (docs/performance.md: 1.09x on a batch-1 forward). No extra memory.
        """
        self.qkv = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (strided views of one fused product when fused)."""
        tokens, d = x.shape[0], self.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv(x).split(
                [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=1
            )
        return q.view(tokens, -1, d), k.view(tokens, -1, d), v.view(tokens, -1, d)

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
        tokens = x.shape[0]
        q, k, v = self._project_qkv(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.heads_forward(q), self.k_norm.heads_forward(k)
        cos, sin = rope
        q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)  # in place (fresh GEMM output)
        slots = inputs.slot_mapping if plan.slot_mapping is None else plan.slot_mapping  # a ring's own
        write_kv(k, v, k_cache, v_cache, slots, plan.host_slot_mapping)  # bounds checked on the host copy
        out = paged_attention(q, k_cache, v_cache, inputs, self.scale, plan, softcap=self.softcap)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, *, bias: bool | None = None):
        """``bias``: the projections' biases (``config.mlp_bias`` when ``None``; Gemma's have none)."""
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        bias = config.mlp_bias if bias is None else bias
        self.gate_proj = Linear(hidden, inner, bias, dtype)
        self.up_proj = Linear(hidden, inner, bias, dtype)
        self.down_proj = Linear(inner, hidden, bias, dtype)
        self.gate_up: Linear | None = None  # set by fuse_gate_up() once the weights are loaded

    def fuse_gate_up(self) -> None:
        """One ``[2 inner, hidden]`` weight for gate and up (they become views of it): one GEMM, one pass."""
        self.gate_up = _fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:  # parts in different formats: the same activation kernel over both
            return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), Activation.SILU))
        return self.down_proj(silu_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    windowed = False  # a sliding-window layer (attends within ``config.sliding_window``; its own plan)

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

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
        """``x`` is the residual stream still missing ``delta`` (the previous layer's MLP output, ``None``
        before the first layer); returns the stream and this layer's MLP output, likewise unadded.

        Why the deferred add: each residual add is fused into the norm that follows it (one pass).
        """
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn(h, rope, inputs, plan, k_cache, v_cache)
        )
        return x, self.mlp(h)


class LlamaModel(nn.Module):
    """The decoder trunk (``model.*`` in HF checkpoints)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, device)


def logits_rows_of(
    x: torch.Tensor, delta: torch.Tensor, inputs: StepInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream ``x`` and the last layer's unadded ``delta`` at the step's logits rows, for the
    final add + norm (which may add into the first in place).

    When the host copy of the rows is every token in order (a decode step: one row per request) and both
    are contiguous, the gather would copy them unchanged: ``x`` itself (the forward's own, no longer needed)
    and ``delta`` are returned. Otherwise the gathered copies, as before. Either way the norm sees the same
    values in the same layout, so the logits' bits do not depend on which
    (``tests/unit/test_decoder_layers.py``).
    """
    host, tokens = inputs.host, x.shape[0]
    if (
        host is not None
        and host.logits_rows.shape[0] == tokens
        and x.is_contiguous()
        and delta.is_contiguous()
        and host.logits_rows.tolist() == list(range(tokens))
    ):
        return x, delta
    rows = inputs.logits_rows
    return x[rows], delta[rows]


def _segments(fused: Linear | None, parts: list[Linear]) -> tuple | None:
    """A fused matrix as its segments: the fused weight, or the parts as stored (different formats)."""
    weights = (fused.weight,) if fused is not None else tuple(p.weight for p in parts)
    return weights if all(isinstance(w, QuantizedWeight) for w in weights) else None


def _stacked_bias(fused: Linear | None, parts: list[Linear]) -> torch.Tensor | None:
    """The fused matrix's bias over all its rows (the parts' biases stacked when they were kept apart)."""
    if fused is not None:
        return fused.bias
    return None if parts[0].bias is None else torch.cat([p.bias for p in parts])


def fused_layer_parts(attn: Attention, mlp: MLP) -> dict | None:
    """The :class:`LayerWeights` fields of a layer's attention and MLP projections (q/k/v and gate/up as
    segments, the q/k norms), or ``None`` when a projection is not kept in a stored format."""
    qkv_parts, gate_up_parts = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    qkv, gate_up = _segments(attn.qkv, qkv_parts), _segments(mlp.gate_up, gate_up_parts)
    if qkv is None or gate_up is None:
        return None
    q_norm, k_norm = attn.q_norm, attn.k_norm
    return dict(
        qkv=qkv,
        qkv_bias=_stacked_bias(attn.qkv, qkv_parts),
        o=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        gate_up=gate_up,
        gate_up_bias=_stacked_bias(mlp.gate_up, gate_up_parts),
        q_norm=None if q_norm is None else q_norm.native_weight,
        k_norm=None if k_norm is None else k_norm.native_weight,
    )


def decoder_dims(
    config: ModelConfig, attn: Attention, activation: Activation = Activation.SILU
) -> DecoderDims:
    """The fused decode path's sizes; the attention scale is the per-layer path's own."""
    return DecoderDims(
        hidden=config.hidden_size,
        q_heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        inner=config.intermediate_size,
        eps=config.rms_norm_eps,
        scale=attn.scale,
        activation=activation,
    )


class TiedHead:
    """The LM head every family's runtime builds and reads the same way (a mixin listed before
    ``nn.Module``): HF's ``lm_head``, or ``None`` when tied, and then the token embedding
    ``model.embed_tokens`` serves as the head."""

    model: nn.Module
    lm_head: Linear | None

    def _init_head(self, config: ModelConfig, dtype: torch.dtype) -> None:
        """Set ``vocab_size`` and ``lm_head`` (after ``self.model``, as HF orders the modules)."""
        self.vocab_size = config.vocab_size
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )

    @property
    def head_weight(self) -> torch.Tensor | QuantizedWeight:
        """``[vocab, hidden]``: the LM head, or the token embedding when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, hidden]`` (the final-normed logits rows) -> ``[R, vocab]`` in the model's dtype."""
        return linear(x, self.head_weight)


class LlamaForCausalLM(TiedHead, nn.Module):
    """A :class:`pagedgen.models.base.CausalLM`: one forward per packed engine step.

    Built with unmaterialised (meta) parameters; :func:`pagedgen.models.weights.load_weights` assigns the
    checkpoint's tensors. ``forward`` runs under ``torch.inference_mode``.
    """

    fixed_state_specs: tuple = ()  # no fixed conv / recurrent state: every layer attends

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.windowed = frozenset(config.windowed_layers)  # sliding-window layers (their own plan)
        self.kv_spec = KVSpec(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            window_size=config.sliding_window,
            window_layers=config.windowed_layers,
        )
        self.model = LlamaModel(config, dtype, device)
        for i in self.windowed:
            self.model.layers[i].windowed = True
        self._init_head(config, dtype)
        self.fused_decoder: FusedDecoder | None = None  # set by fuse_projections() when it can run

    def fuse_projections(self) -> None:
        """Fuse each layer's q/k/v and gate/up weights (after loading; the state-dict names stay valid), and
        build the one-call decode path (:mod:`pagedgen.ops.layers.decoder_layers`) when the weights allow."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            layer.mlp.fuse_gate_up()
        self.fused_decoder = self._build_fused_decoder()

    def _build_fused_decoder(self) -> FusedDecoder | None:
        """``None`` unless every layer is the plain pre-norm block with stored-format projections."""
        if self.dtype is not torch.float32:
            return None
        layers = []
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            parts = fused_layer_parts(attn, mlp)
            if parts is None:
                return None
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.native_weight,
                    post_norm=layer.post_attention_layernorm.native_weight,
                    down=mlp.down_proj.weight,
                    down_bias=mlp.down_proj.bias,
                    windowed=i in self.windowed,
                    **parts,
                )
            )
        return FusedDecoder.build(layers, decoder_dims(self.config, self.model.layers[0].self_attn))

    def _window_plan(self, inputs: StepInputs, kv_cache: PagedKVCache) -> AttentionPlan | None:
        """The sliding-window layers' plan (their ring, or the block tables masked to the window)."""
        if not self.windowed:
            return None
        first = min(self.windowed)
        return plan_attention(inputs, kv_cache.keys[first], window=self.config.sliding_window)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_cache: PagedKVCache) -> torch.Tensor:
        """Float32 logits ``[len(inputs.logits_rows), vocab]``; mutates ``kv_cache`` at ``slot_mapping``."""
        if len(kv_cache.keys) != len(self.model.layers):
            raise ValueError(f"kv_cache has {len(kv_cache.keys)} layers, the model {len(self.model.layers)}")
        x = self.model.embed_tokens(inputs.input_ids)  # [T, hidden]
        rope = self.model.rotary_emb(inputs.positions, x.dtype)  # 2 x [T, head_dim]
        plan = plan_attention(inputs, kv_cache.keys[0])  # once per step, shared by every layer
        window_plan = self._window_plan(inputs, kv_cache)  # the sliding-window layers' (None without)
        fused = self.fused_decoder
        if fused is not None and fused.supports(x, inputs, plan, window_plan):
            x, delta = fused.run(x, rope, inputs, plan, kv_cache.keys, kv_cache.values, window_plan)
        else:
            delta = None
            for layer, k_cache, v_cache in zip(
                self.model.layers, kv_cache.keys, kv_cache.values, strict=True
            ):
                layer_plan = window_plan if layer.windowed else plan
                x, delta = layer(x, delta, rope, inputs, layer_plan, k_cache, v_cache)
        _, x = self.model.norm.add_forward(*logits_rows_of(x, delta, inputs))  # [R, hidden]: one native call
        return self._head(x).float()  # [R, vocab]
