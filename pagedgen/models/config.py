"""The architecture description of a decoder, parsed from an HF ``config.json`` dict.

One frozen :class:`ModelConfig` covers every family :mod:`pagedgen.models.llama` implements, LFM2
(:mod:`pagedgen.models.lfm2`: the Llama-style fields plus its convolution layers, ``conv_*``), Gemma 2 / 3
(:mod:`pagedgen.models.gemma`: the query scale, soft-capping and Gemma 3's local RoPE) and Bamba
(:mod:`pagedgen.models.bamba`: the Llama-style fields plus its Mamba-2 mixer layers, ``mamba_*``; also
GraniteMoeHybrid with a dense MLP, which adds Granite's multipliers). The family is chosen from the
config's ``model_type`` (or, failing that, its ``architectures`` list); its traits (q/k/v bias, per-head
q/k RMSNorm) come from :data:`FAMILY_TRAITS` and the config's own flags. Anything we do not implement
(another family, another RoPE scaling, another activation) is refused here, before any weight is read, with
an error that names the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pagedgen.core.json_value import JsonValue
from pagedgen.errors import ModelLoadError, UnsupportedArchitectureError

GELU_TANH = "gelu_pytorch_tanh"  # Gemma's MLP activation (GELU, tanh approximation)


@dataclass(frozen=True, slots=True)
class FamilyTraits:
    """What distinguishes one member of the Llama family from another in our single implementation."""

    qkv_bias: bool | None  # None: read the config's ``attention_bias`` flag
    qk_norm: bool
    use_sliding_window: bool = True  # what an absent ``use_sliding_window`` key means (transformers' default)
    hidden_act: str = "silu"  # the MLP gate activation the family's runtime implements
    local_rope: bool = False  # sliding-window layers rotate with their own RoPE (Gemma 3)


FAMILY_TRAITS: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(qkv_bias=None, qk_norm=False),
    "mistral": FamilyTraits(qkv_bias=False, qk_norm=False),
    "qwen2": FamilyTraits(qkv_bias=True, qk_norm=False, use_sliding_window=False),
    "qwen3": FamilyTraits(qkv_bias=None, qk_norm=True, use_sliding_window=False),
    "lfm2": FamilyTraits(qkv_bias=False, qk_norm=True, use_sliding_window=False),
    "gemma2": FamilyTraits(qkv_bias=None, qk_norm=False, hidden_act=GELU_TANH),
    "gemma3_text": FamilyTraits(qkv_bias=None, qk_norm=True, hidden_act=GELU_TANH, local_rope=True),
    "bamba": FamilyTraits(qkv_bias=None, qk_norm=False, use_sliding_window=False),
    "granitemoehybrid": FamilyTraits(qkv_bias=None, qk_norm=False, use_sliding_window=False),
}
GEMMA_FAMILIES = ("gemma2", "gemma3_text")

# What an absent key means in each Gemma config (transformers' Gemma2Config / Gemma3TextConfig defaults).
# ``sliding_window_pattern``: every n-th layer attends fully, the others within the window.
_GEMMA_DEFAULTS: dict[str, dict[str, JsonValue]] = {
    "gemma2": {
        "sliding_window": 4096,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "tie_word_embeddings": True,
    },
}

CONV = "conv"  # LFM2's ``layer_types`` entry of a short-convolution layer

SLIDING, FULL = "sliding_attention", "full_attention"  # HF ``layer_types`` entries

_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Lfm2ForCausalLM": "lfm2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}

# ``freq_factors``: per-frequency divisors shipped as a weight (llama.cpp's ``rope_freqs``, Llama 3.x GGUFs).
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")

_POSITIVE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters: the base and an optional frequency scaling (see :data:`ROPE_TYPES`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeConfig.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not self.theta > 0:
            raise ValueError(f"RopeConfig.theta must be positive, got {self.theta}")
        if not self.factor > 0:
            raise ValueError(f"RopeConfig.factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeConfig.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor}) for llama3 scaling"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes and traits of one decoder; validated so a model built from it cannot mis-shape a tensor."""

    architecture: str  # family key of FAMILY_TRAITS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # window of the sliding-window layers (keys p - W + 1 .. p)
    window_layers: tuple[int, ...] | None = None  # the windowed layers; None with a window: every layer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    conv_layers: tuple[int, ...] = ()  # short-convolution layers (LFM2): fixed conv state, no attention
    conv_kernel: int = 0  # taps of those convolutions (``conv_L_cache``)
    conv_bias: bool = False
    query_scale: float | None = None  # scores scaled by query_scale ** -0.5 (Gemma); None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores soft-capped: cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped likewise (Gemma 2 / 3)
    local_rope: RopeConfig | None = None  # the sliding-window layers' own RoPE (Gemma 3); None: ``rope``
    mamba_layers: tuple[int, ...] = ()  # Mamba-2 mixer layers (Bamba): fixed conv + recurrent state, no K/V
    mamba_heads: int = 0  # SSM heads (``mamba_n_heads``)
    mamba_head_dim: int = 0  # channels per SSM head (``mamba_d_head``); heads x head_dim = expand x hidden
    mamba_state: int = 0  # N, the state size per channel (``mamba_d_state``)
    mamba_groups: int = 1  # B/C groups; the heads of a group share B and C (``mamba_n_groups``)
    mamba_conv_kernel: int = 0  # taps of the mixer's causal convolution (``mamba_d_conv``)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)  # clamp of softplus(dt + dt_bias)
    partial_rotary_factor: float = 1.0  # share of each head's dims RoPE rotates (Bamba 0.5; 0: no RoPE)
    embedding_multiplier: float = 1.0  # scales the token embedding (Granite)
    residual_multiplier: float = 1.0  # scales each mixer / MLP output before its residual add (Granite)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Granite: its own)
    logits_scaling: float = 1.0  # the logits are divided by it (Granite)

    def __post_init__(self) -> None:
        if self.architecture not in FAMILY_TRAITS:
            raise ValueError(
                f"ModelConfig.architecture must be one of {sorted(FAMILY_TRAITS)}, got {self.architecture!r}"
            )
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window must be positive or None, got {self.sliding_window}"
            )
        if self.window_layers is not None:
            if self.sliding_window is None and self.window_layers:
                raise ValueError(
                    f"ModelConfig.window_layers {self.window_layers} given without a sliding_window"
                )
            if any(not 0 <= i < self.num_layers for i in self.window_layers):
                raise ValueError(
                    f"ModelConfig.window_layers {self.window_layers} must be layers 0..{self.num_layers - 1}"
                )
        if any(not 0 <= i < self.num_layers for i in self.conv_layers) or len(set(self.conv_layers)) != len(
            self.conv_layers
        ):
            raise ValueError(
                f"ModelConfig.conv_layers {self.conv_layers} must be distinct layers 0..{self.num_layers - 1}"
            )
        if self.conv_layers and self.conv_kernel < 2:
            raise ValueError(f"ModelConfig.conv_kernel must be >= 2 with conv layers, got {self.conv_kernel}")
        for name in ("query_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be positive or None, got {value!r}")
        if not 0 <= self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"ModelConfig.partial_rotary_factor must be in [0, 1] and rotate an even number of dims, got "
                f"{self.partial_rotary_factor} ({self.rotary_dim} of {self.head_dim})"
            )
        for name in ("embedding_multiplier", "residual_multiplier", "attention_scale", "logits_scaling"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {value!r}")
        if self.mamba_layers:
            self._check_mamba()

    def _check_mamba(self) -> None:
        layers = self.mamba_layers
        if any(not 0 <= i < self.num_layers for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(
                f"ModelConfig.mamba_layers {layers} must be distinct layers 0..{self.num_layers - 1}"
            )
        if set(layers) & set(self.conv_layers):
            raise ValueError(f"ModelConfig.mamba_layers {layers} overlap conv_layers {self.conv_layers}")
        for name in ("mamba_heads", "mamba_head_dim", "mamba_state", "mamba_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"ModelConfig.{name} must be a positive int with Mamba layers, got {value!r}"
                )
        if self.mamba_heads % self.mamba_groups:
            raise ValueError(
                f"ModelConfig.mamba_heads ({self.mamba_heads}) must be a multiple of "
                f"mamba_groups ({self.mamba_groups})"
            )
        if self.mamba_conv_kernel < 2:
            raise ValueError(
                f"ModelConfig.mamba_conv_kernel must be >= 2 with Mamba layers, got {self.mamba_conv_kernel}"
            )
        low, high = self.time_step_limit
        if not 0 <= low <= high:
            raise ValueError(
                f"ModelConfig.time_step_limit must be 0 <= low <= high, got {self.time_step_limit}"
            )

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """The layers that attend within ``sliding_window`` (ascending)."""
        if self.sliding_window is None:
            return ()
        if self.window_layers is None:
            return tuple(range(self.num_layers))
        return tuple(sorted(self.window_layers))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and own paged K/V): every layer but the convolution and Mamba ones."""
        other = set(self.conv_layers) | set(self.mamba_layers)
        return tuple(i for i in range(self.num_layers) if i not in other)

    @property
    def conv_state_layers(self) -> tuple[int, ...]:
        """The layers that keep a convolution window as fixed_conv state: LFM2 conv and Mamba layers."""
        return tuple(sorted({*self.conv_layers, *self.mamba_layers}))

    @property
    def recurrent_state_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent (SSM) state as fixed_recurrent state: the Mamba layers."""
        return tuple(sorted(self.mamba_layers))

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (the rest pass through), as transformers rounds."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mamba_inner(self) -> int:
        """Channels of a Mamba layer's SSM input, gate and gated-norm output: heads x head_dim."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the mixer's convolution (its fixed_conv row width): x, then B and C of every group."""
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state

    @property
    def max_context(self) -> int:
        """Longest sequence served: sliding-window layers attend within their window at any length."""
        return self.max_position_embeddings

    def to_hf_dict(self) -> dict[str, JsonValue]:
        """An HF-style ``config.json`` dict that :func:`config_from_hf` parses back to an equal config."""
        rope_parameters = _rope_dict(self.rope)
        data: dict[str, JsonValue] = {
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": FAMILY_TRAITS[self.architecture].hidden_act,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "layer_types": [SLIDING if i in self.windowed_layers else FULL for i in range(self.num_layers)],
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.architecture == "lfm2":
            data.update(
                layer_types=[CONV if i in self.conv_layers else FULL for i in range(self.num_layers)],
                conv_L_cache=self.conv_kernel,
                conv_bias=self.conv_bias,
                norm_eps=self.rms_norm_eps,
                block_auto_adjust_ff_dim=False,
            )
        if self.architecture in GEMMA_FAMILIES:
            data.update(
                query_pre_attn_scalar=_hf_int(self.query_scale),
                attn_logit_softcapping=self.attn_softcap,
                final_logit_softcapping=self.final_softcap,
            )
            if self.local_rope is not None:
                data["rope_parameters"] = {FULL: rope_parameters, SLIDING: _rope_dict(self.local_rope)}
        return data


def _hf_int(value: float | None) -> JsonValue:
    """An integral ``value`` as the int transformers' config classes declare (their strict validation
    refuses ``256.0`` for an ``int`` field); others as they are."""
    return int(value) if value is not None and float(value).is_integer() else value


def _rope_dict(rope: RopeConfig) -> dict[str, JsonValue]:
    """``rope`` as transformers 5's ``rope_parameters``."""
    params: dict[str, JsonValue] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type != "default":
        params["factor"] = rope.factor
    if rope.rope_type == "llama3":
        params.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    return params


def resolve_architecture(raw: Mapping[str, JsonValue], source: str) -> str:
    """The family key for a config dict; raises :class:`UnsupportedArchitectureError` naming what it found."""
    model_type = raw.get("model_type")
    if model_type in FAMILY_TRAITS:
        return str(model_type)
    for class_name in raw.get("architectures") or ():
        if class_name in _ARCHITECTURE_CLASSES:
            return _ARCHITECTURE_CLASSES[class_name]
    named = model_type or ", ".join(raw.get("architectures") or ()) or "<none given>"
    raise UnsupportedArchitectureError(
        f"{source}: unsupported architecture {named!r} "
        f"(architectures {list(raw.get('architectures') or [])}); supported model_type values: "
        f"{sorted(FAMILY_TRAITS)}"
    )


def config_from_hf(raw: Mapping[str, JsonValue], source: str) -> ModelConfig:
    """Parse an HF ``config.json`` dict (transformers 4.x or 5.x spelling) into a :class:`ModelConfig`.

    Raises :class:`UnsupportedArchitectureError` for a family we do not implement and
    :class:`ModelLoadError` naming ``source`` and the field for a missing or unsupported value.
    """
    _refuse_multimodal(raw, source)
    architecture = resolve_architecture(raw, source)
    traits = FAMILY_TRAITS[architecture]
    gemma = architecture in GEMMA_FAMILIES
    if gemma:
        raw = _gemma_defaults(raw, architecture, source)
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if gemma:  # transformers' Gemma reads ``hidden_activation``; ``hidden_act`` is Gemma 1's leftover
        act = raw.get("hidden_activation") or raw.get("hidden_act") or GELU_TANH
    if act != traits.hidden_act:
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only {traits.hidden_act!r})")
    hidden = _require_int(raw, "hidden_size", source)
    num_heads = _require_int(raw, "num_attention_heads", source)
    head_dim = raw.get("head_dim") or hidden // num_heads
    qkv_bias = traits.qkv_bias if traits.qkv_bias is not None else bool(raw.get("attention_bias", False))
    num_layers = _require_int(raw, "num_hidden_layers", source)
    window, window_layers = _sliding_window(raw, traits, num_layers, source)
    if gemma:
        family = _gemma_fields(raw, architecture, source)
    else:
        family = (
            _FAMILY_FIELDS[architecture](raw, num_layers, source) if architecture in _FAMILY_FIELDS else {}
        )
    inner = family.pop("intermediate_size", None) or _require_int(raw, "intermediate_size", source)
    eps = family.pop("rms_norm_eps", None) or raw.get("rms_norm_eps", 1e-6)
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=_require_int(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=inner,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=_require_int(raw, "max_position_embeddings", source),
            rms_norm_eps=float(eps),
            rope=family.pop("rope", None) or _rope_from_hf(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", architecture == "lfm2")),
            qkv_bias=qkv_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            sliding_window=window,
            window_layers=window_layers,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
            **family,
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: invalid model config: {exc}") from exc


def _require_int(raw: Mapping[str, JsonValue], key: str, source: str) -> int:
    value = raw.get(key)
    if value is None:
        raise ModelLoadError(f"{source}: config field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ModelLoadError(f"{source}: config field {key!r} must be an integer, got {value!r}")
    return int(value)


def _int_tuple(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_window(
    raw: Mapping[str, JsonValue], traits: FamilyTraits, num_layers: int, source: str
) -> tuple[int | None, tuple[int, ...] | None]:
    """``(window, windowed layers)`` from the HF keys, or ``(None, None)`` when every layer attends fully.

    ``sliding_window`` is the window; ``use_sliding_window: false`` turns it off; the windowed layers are
    those ``layer_types`` calls ``sliding_attention``, else those from ``max_window_layers`` on (Qwen2's
    rule), else all. A window no shorter than ``max_position_embeddings`` never hides a key: no window.
    """
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", traits.use_sliding_window):
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{source}: sliding_window must be a positive integer, got {window!r}")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelLoadError(
                f"{source}: layer_types must list {num_layers} layer types, got {layer_types!r}"
            )
        unknown = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
        if unknown:
            raise ModelLoadError(
                f"{source}: layer_types {unknown} are not supported (only {SLIDING!r}, {FULL!r})"
            )
        layers = tuple(i for i, t in enumerate(layer_types) if t == SLIDING)
    elif raw.get("max_window_layers") is not None:
        layers = tuple(range(min(int(raw["max_window_layers"]), num_layers), num_layers))
    else:
        layers = tuple(range(num_layers))
    if not layers or (window >= int(raw.get("max_position_embeddings") or 0) and not traits.local_rope):
        return None, None  # (layers with their own RoPE stay marked, whatever their window)
    return window, None if len(layers) == num_layers else layers


def _rope_from_hf(raw: Mapping[str, JsonValue], source: str) -> RopeConfig:
    """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope scaling type {rope_type!r} is not supported (supported: {ROPE_TYPES})"
        )
    try:
        if rope_type in ("default", "freq_factors"):  # unused scaling fields keep their defaults
            return RopeConfig(theta=theta, rope_type=rope_type)
        if rope_type == "linear":
            return RopeConfig(theta=theta, rope_type=rope_type, factor=float(merged.get("factor", 1.0)))
        original = merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        return RopeConfig(
            theta=theta,
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: invalid rope parameters {merged}: {exc}") from exc


def _lfm2_fields(raw: Mapping[str, JsonValue], num_layers: int, source: str) -> dict[str, JsonValue]:
    """LFM2's own keys: which layers convolve (``layer_types``, else ``full_attn_idxs``), the convolution's
    taps and bias, ``norm_eps``, and the MLP width after its ``block_*`` adjustment (transformers' rule)."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        attention = raw.get("full_attn_idxs")
        attention = range(num_layers) if attention is None else attention
        layer_types = [FULL if i in attention else CONV for i in range(num_layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or not set(layer_types) <= {CONV, FULL}
    ):
        raise ModelLoadError(
            f"{source}: layer_types must list {num_layers} of {CONV!r} / {FULL!r}, got {layer_types!r}"
        )
    inner = _require_int(raw, "intermediate_size", source)
    if raw.get("block_auto_adjust_ff_dim", True):
        inner = int(2 * inner / 3)
        multiplier = raw.get("block_ffn_dim_multiplier")
        if multiplier is not None:
            multiple_of = int(raw.get("block_multiple_of", 256))
            inner = int(multiplier * inner)
            inner = multiple_of * ((inner + multiple_of - 1) // multiple_of)
    return {
        "conv_layers": tuple(i for i, t in enumerate(layer_types) if t == CONV),
        "conv_kernel": int(raw.get("conv_L_cache", 3)),
        "conv_bias": bool(raw.get("conv_bias", False)),
        "intermediate_size": inner,
        "rms_norm_eps": float(raw.get("norm_eps", 1e-5)),
    }


def _refuse_multimodal(raw: Mapping[str, JsonValue], source: str) -> None:
    """Gemma 3's multimodal wrapper (``gemma3``: a ``text_config`` inside, weights under
    ``model.language_model``) is not the text model we run; say so rather than fail on weight names."""
    classes = raw.get("architectures") or ()
    if raw.get("model_type") == "gemma3" or "Gemma3ForConditionalGeneration" in classes:
        raise UnsupportedArchitectureError(
            f"{source}: model_type 'gemma3' (Gemma3ForConditionalGeneration, image + text) is not supported; "
            "only the text model 'gemma3_text' (Gemma3ForCausalLM) is"
        )


def _gemma_defaults(raw: Mapping[str, JsonValue], architecture: str, source: str) -> dict[str, JsonValue]:
    """``raw`` with transformers' Gemma defaults for absent keys and ``layer_types`` spelled out from the
    family's pattern (every ``sliding_window_pattern``-th layer full, the others sliding) when absent."""
    defaults = _GEMMA_DEFAULTS[architecture]
    full = {**defaults, **raw}
    for key in ("sliding_window_pattern", "rope_theta", "rope_local_base_freq"):  # null means the default
        if full.get(key) is None and key in defaults:
            full[key] = defaults[key]
    if full.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{source}: use_bidirectional_attention is not supported (a causal decoder only)"
        )
    if full.get("layer_types") is None:
        pattern = full["sliding_window_pattern"]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ModelLoadError(
                f"{source}: sliding_window_pattern must be a positive integer, got {pattern!r}"
            )
        layers = _require_int(full, "num_hidden_layers", source)
        full["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    return full


def _gemma_fields(raw: Mapping[str, JsonValue], architecture: str, source: str) -> dict[str, JsonValue]:
    """Gemma's own keys: the query scale, the soft-caps, and (Gemma 3) a RoPE per layer type: transformers
    5's ``rope_parameters`` keyed by ``full_attention`` / ``sliding_attention``, or 4.x's ``rope_theta`` +
    ``rope_scaling`` (global layers) and ``rope_local_base_freq`` (sliding layers)."""
    attn_softcap = raw.get("attn_logit_softcapping")
    if architecture == "gemma3_text" and attn_softcap is not None:
        raise ModelLoadError(
            f"{source}: attn_logit_softcapping {attn_softcap!r} is not part of Gemma 3 (transformers "
            "ignores it, llama.cpp refuses it); expected null"
        )
    fields: dict[str, JsonValue] = {
        "query_scale": _optional_float(raw, "query_pre_attn_scalar", source),
        "attn_softcap": _optional_float(raw, "attn_logit_softcapping", source),
        "final_softcap": _optional_float(raw, "final_logit_softcapping", source),
    }
    if architecture == "gemma3_text":
        params = raw.get("rope_parameters") or {}
        if FULL in params or SLIDING in params:  # a type without rope_theta gets the family's base
            full = {"rope_theta": raw["rope_theta"], **(params.get(FULL) or {})}
            local = {"rope_theta": raw["rope_local_base_freq"], **(params.get(SLIDING) or {})}
            fields["rope"] = _rope_from_hf({"rope_parameters": full}, source)
            fields["local_rope"] = _rope_from_hf({"rope_parameters": local}, source)
        else:
            fields["local_rope"] = RopeConfig(theta=float(raw["rope_local_base_freq"]))
    return fields


def _optional_float(raw: Mapping[str, JsonValue], key: str, source: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ModelLoadError(
            f"{source}: config field {key!r} must be a positive number or null, got {value!r}"
        )
    return float(value)


def _bamba_fields(raw: Mapping[str, JsonValue], num_layers: int, source: str) -> dict[str, JsonValue]:
    """Bamba's own keys: which layers attend (``attn_layer_indices``; every other layer is a Mamba-2 mixer),
    the mixer's (:func:`_mamba_fields`) and the RoPE fraction (transformers' Bamba default is 0.5)."""
    attention = raw.get("attn_layer_indices") or []
    if not isinstance(attention, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in attention
    ):
        raise ModelLoadError(
            f"{source}: attn_layer_indices must list layer ids 0..{num_layers - 1}, got {attention!r}"
        )
    rope = raw.get("rope_parameters") or {}
    return {
        **_mamba_fields(raw, attention, num_layers, "attn_layer_indices", source),
        "partial_rotary_factor": float(
            rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
        ),
    }


_GRANITE_LAYER_TYPES = {"mamba": False, "linear_attention": False, "attention": True, "full_attention": True}


def _granite_hybrid_fields(
    raw: Mapping[str, JsonValue], num_layers: int, source: str
) -> dict[str, JsonValue]:
    """GraniteMoeHybrid's keys, dense-MLP variant only: ``layer_types`` (``mamba`` / ``attention``, or
    transformers 5's ``linear_attention`` / ``full_attention``), the mixer's (:func:`_mamba_fields`), the MLP
    width ``shared_intermediate_size``, Granite's multipliers, and RoPE only when ``position_embedding_type``
    is ``rope`` (Granite 4.0's ``nope`` attention has no positional encoding).

    A mixture-of-experts config (``num_local_experts`` > 0; transformers' default is 8) is refused: only the
    shared MLP is implemented.
    """
    experts = raw.get("num_local_experts", 8)
    if experts != 0 or isinstance(experts, bool):  # absent or null is not dense either
        raise ModelLoadError(
            f"{source}: num_local_experts is {experts!r}: GraniteMoeHybrid's mixture-of-experts MLP is not "
            "supported (only the dense variant, num_local_experts 0, whose MLP is shared_mlp)"
        )
    layer_types = raw.get("layer_types") or ["mamba"] * num_layers
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or not set(layer_types) <= set(_GRANITE_LAYER_TYPES)
    ):
        raise ModelLoadError(
            f"{source}: layer_types must list {num_layers} of {sorted(_GRANITE_LAYER_TYPES)}, "
            f"got {layer_types!r}"
        )
    position = raw.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ModelLoadError(
            f"{source}: position_embedding_type {position!r} is not supported (only 'rope', 'nope' or null)"
        )
    attention = [i for i, t in enumerate(layer_types) if _GRANITE_LAYER_TYPES[t]]
    return {
        **_mamba_fields(raw, attention, num_layers, "layer_types", source),
        "intermediate_size": _require_int(raw, "shared_intermediate_size", source),
        "partial_rotary_factor": 1.0 if position == "rope" else 0.0,
        "embedding_multiplier": _float_field(raw, "embedding_multiplier", source),
        "residual_multiplier": _float_field(raw, "residual_multiplier", source),
        "attention_scale": _float_field(raw, "attention_multiplier", source),
        "logits_scaling": _float_field(raw, "logits_scaling", source),
    }


def _mamba_fields(
    raw: Mapping[str, JsonValue], attention: list[int], num_layers: int, key: str, source: str
) -> dict[str, JsonValue]:
    """The Mamba-2 mixer's keys (``mamba_*``, ``time_step_limit``), shared by Bamba and GraniteMoeHybrid;
    every layer outside ``attention`` (named by the config's ``key``) is a mixer.

    Absent mixer keys take transformers' defaults; inconsistent ones are refused naming the field, before
    any weight is read.
    """
    if not attention:
        raise ModelLoadError(
            f"{source}: {key} names no attention layer: a Mamba-only model is not supported (the engine "
            "keeps one paged K/V group, so a hybrid needs at least one attention layer)"
        )
    hidden = _require_int(raw, "hidden_size", source)
    heads = _int_field(raw, "mamba_n_heads", 128, source)
    if heads <= 0:
        raise ModelLoadError(f"{source}: mamba_n_heads must be positive, got {heads}")
    expand = _int_field(raw, "mamba_expand", 2, source)
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = expand * hidden // heads if head_dim == "auto" else _int_field(raw, "mamba_d_head", 0, source)
    if heads * head_dim != expand * hidden:
        raise ModelLoadError(
            f"{source}: mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) must equal mamba_expand x "
            f"hidden_size ({expand} x {hidden})"
        )
    groups = _int_field(raw, "mamba_n_groups", 1, source)
    if heads % groups:
        raise ModelLoadError(
            f"{source}: mamba_n_heads ({heads}) must be a multiple of mamba_n_groups ({groups})"
        )
    return {
        "mamba_layers": tuple(i for i in range(num_layers) if i not in attention),
        "mamba_heads": heads,
        "mamba_head_dim": head_dim,
        "mamba_state": _int_field(raw, "mamba_d_state", 256, source),
        "mamba_groups": groups,
        "mamba_conv_kernel": _int_field(raw, "mamba_d_conv", 4, source),
        "mamba_conv_bias": bool(raw.get("mamba_conv_bias", True)),
        "mamba_proj_bias": bool(raw.get("mamba_proj_bias", False)),
        "time_step_limit": _time_step_limit(raw.get("time_step_limit", (0.0, math.inf)), source),
    }


def _int_field(raw: Mapping[str, JsonValue], key: str, default: int, source: str) -> int:
    """``raw[key]`` as an int (``default`` when absent); raises :class:`ModelLoadError` naming the key."""
    return default if raw.get(key) is None else _require_int(raw, key, source)


def _float_field(raw: Mapping[str, JsonValue], key: str, source: str) -> float:
    """``raw[key]`` as a float, 1.0 when absent or null (Granite's multipliers' default)."""
    value = raw.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{source}: config field {key!r} must be a number, got {value!r}")
    return float(value)


def _time_step_limit(value: object, source: str) -> tuple[float, float]:
    """``(low, high)`` from a 2-list (``null``: no clamp); transformers 5 writes an infinite bound as
    ``{"__float__": "Infinity"}``."""
    if value is None:
        return (0.0, math.inf)
    bounds = (
        [v.get("__float__") if isinstance(v, Mapping) else v for v in value]
        if isinstance(value, list | tuple)
        else []
    )
    try:
        low, high = (float(v) for v in bounds)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{source}: time_step_limit must be [low, high], got {value!r}") from None
    return (low, high)


_FAMILY_FIELDS = {"lfm2": _lfm2_fields, "bamba": _bamba_fields, "granitemoehybrid": _granite_hybrid_fields}
