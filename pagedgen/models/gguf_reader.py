"""Read a llama.cpp GGUF file into our config and float32 weights, named like an HF checkpoint.

Built on the ``gguf`` package; what llama.cpp does differently from an HF checkpoint (names, the Q/K
permutation, config keys, per-family layouts) is undone here, so every model family reads one format. The
list: docs/models.md, "GGUF files: reading".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pagedgen.core.json_value import JsonValue
from pagedgen.errors import ModelLoadError, UnsupportedArchitectureError
from pagedgen.models.config import FULL, GEMMA_FAMILIES, SLIDING, ModelConfig, config_from_hf

if TYPE_CHECKING:
    import gguf

MetadataGetter = Callable[[str, JsonValue], JsonValue]  # an architecture's ``{arch}.key`` lookup

GGUF_MAGIC = b"GGUF"

# ggml types we dequantise; any other raises naming its type.
SUPPORTED_TYPES = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
)

# GGUF ``general.architecture`` -> our family key. llama.cpp writes Mistral 1-2 models as ``llama``.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "lfm2": "lfm2",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}

FREQ_FACTORS_NAME = "model.rotary_emb.freq_factors"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": FREQ_FACTORS_NAME,
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# LFM2 (llama.cpp's ``lfm2``): its own HF names for the shared llama.cpp parts, plus the short convolution.
_LFM2_GLOBAL_NAMES = {**_GLOBAL_NAMES, "token_embd_norm.weight": "model.embedding_norm.weight"}
_LFM2_BLOCK_NAMES = {
    "attn_norm": "operator_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}
# Gemma 2 / 3: the four sandwich norms; the rest is named as for Llama.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# llama.cpp's Gemma rules (src/llama-model.cpp): every n-th layer global, the others sliding; the sliding
# layers of Gemma 3 rotate with base 10000 unless the file says otherwise; and the 27B models (by layer
# count) scale queries by hidden / heads instead of the head size.
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_LOCAL_ROPE_BASE = 10_000.0

_LFM2_CONV = "conv.conv.weight"  # llama.cpp stores it squeezed, [hidden, L]; HF as [hidden, 1, L]

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_.]+)\.(weight|bias)$")


@dataclass(slots=True)
class GGUFFile:
    """An opened GGUF file: its path, ``gguf.GGUFReader`` and the decoded scalar/string metadata."""

    path: Path
    reader: gguf.GGUFReader
    metadata: dict[str, JsonValue]  # scalar and string fields only; arrays are read on demand

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing general.architecture>"))

    def array(self, key: str) -> list[JsonValue] | None:
        """A metadata array (tokens, merges, token types), decoded to a Python list, or None if absent."""
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()


def open_gguf(path: Path) -> GGUFFile:
    """Open and parse a GGUF header; raises :class:`ModelLoadError` if missing, truncated or foreign."""
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader signals truncation with ValueError/IndexError/struct errors
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({type(exc).__name__}: {exc})") from exc
    metadata = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            metadata[key] = field.contents()
    return GGUFFile(path=path, reader=reader, metadata=metadata)


def family_of(file: GGUFFile) -> str:
    """Our family key for the file's ``general.architecture``; refuses the rest naming it."""
    arch = file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{file.path}: unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return GGUF_ARCHITECTURES[arch]


def gguf_config(file: GGUFFile) -> ModelConfig:
    """The model config from ``{arch}.*`` metadata, in HF spelling, parsed by :func:`config_from_hf`."""
    family = family_of(file)
    arch = file.architecture
    meta = file.metadata

    def get(key: str, default: JsonValue = None) -> JsonValue:
        return meta.get(f"{arch}.{key}", default)

    names = {t.name for t in file.reader.tensors}
    hidden = get("embedding_length")
    heads = get("attention.head_count")
    vocab = get("vocab_size")
    if vocab is None and (tokens := file.reader.fields.get("tokenizer.ggml.tokens")) is not None:
        vocab = len(tokens.data)
    raw: dict[str, JsonValue] = {
        "model_type": family,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length"),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": _gguf_rope(file, names),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "sliding_window": get("attention.sliding_window"),
        "use_sliding_window": get("attention.sliding_window") is not None,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if family == "lfm2":
        raw.update(_lfm2_gguf_config(file, get))
    if family in GEMMA_FAMILIES:
        raw.update(_gemma_gguf_config(file, get, raw))
    return config_from_hf(raw, str(file.path))


def _lfm2_gguf_config(file: GGUFFile, get: MetadataGetter) -> dict[str, JsonValue]:
    """LFM2's keys, as llama.cpp's converter writes them: a per-layer KV-head array (0 for a convolution
    layer), ``shortconv.l_cache``, and the MLP width already adjusted."""
    kv_heads = file.array(f"{file.architecture}.attention.head_count_kv")
    if kv_heads is None:
        kv_heads = [get("attention.head_count_kv")] * int(get("block_count") or 0)
    kv_heads = [int(n) for n in kv_heads]
    return {
        "layer_types": ["full_attention" if n else "conv" for n in kv_heads],
        "num_key_value_heads": max(kv_heads, default=0) or None,
        "conv_L_cache": get("shortconv.l_cache"),
        "norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "block_auto_adjust_ff_dim": False,
    }


def _gemma_gguf_config(
    file: GGUFFile, get: MetadataGetter, raw: dict[str, JsonValue]
) -> dict[str, JsonValue]:
    """Gemma's keys as llama.cpp reads them: the window (Gemma 2: 4096 when absent; Gemma 3: no window when
    absent), the sliding layers from ``attention.sliding_window_pattern`` (a period or one flag per layer)
    or the architecture's period, the soft-caps (absent: transformers' defaults), the query scale by
    llama.cpp's rule, and Gemma 3's RoPE per layer type (global: ``rope.*``; local: ``rope.freq_base_swa``).
    """
    arch = file.architecture
    layers = int(get("block_count") or 0)
    extra: dict[str, JsonValue] = {"layer_types": _gemma_layer_types(file, arch, layers)}
    window = get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    extra.update(sliding_window=window, use_sliding_window=window is not None)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in file.metadata:
            extra[key] = get(key)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    big = layers == _GEMMA_27B_LAYERS[arch] and hidden and heads
    extra["query_pre_attn_scalar"] = hidden // heads if big else raw["head_dim"]  # None: the head size
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": get("rope.freq_base_swa", _GEMMA_LOCAL_ROPE_BASE)}
        extra["rope_parameters"] = {FULL: raw["rope_parameters"], SLIDING: local}
    return extra


def _gemma_layer_types(file: GGUFFile, arch: str, layers: int) -> list[str]:
    """``sliding_attention`` / ``full_attention`` per layer; raises :class:`ModelLoadError` for a pattern
    that is neither a positive period nor one flag per layer."""
    key = f"{arch}.attention.sliding_window_pattern"
    flags = None if key in file.metadata else file.array(key)  # metadata holds the scalars
    if flags is None:
        period = file.metadata.get(key, _GEMMA_SWA_PATTERN[arch])
        if isinstance(period, bool) or not isinstance(period, int) or period <= 0:
            raise ModelLoadError(f"{file.path}: {key} must be a positive period, got {period!r}")
        flags = [i % period < period - 1 for i in range(layers)]
    if len(flags) != layers:
        raise ModelLoadError(f"{file.path}: {key} lists {len(flags)} layers, the model has {layers}")
    return [SLIDING if flag else FULL for flag in flags]


def _gguf_rope(file: GGUFFile, names: set[str]) -> dict[str, JsonValue]:
    arch = file.architecture
    meta = file.metadata
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in names:
        return {"rope_type": "freq_factors", "rope_theta": theta}
    if scaling in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {
            "rope_type": "linear",
            "rope_theta": theta,
            "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0),
        }
    return {"rope_type": str(scaling), "rope_theta": theta}  # refused by config_from_hf, naming it


def our_tensor_name(gguf_name: str, source: Path | str, family: str = "llama") -> str:
    """Map a llama.cpp tensor name to our (HF) name for ``family``; raises :class:`ModelLoadError` for an
    unknown one."""
    lfm2 = family == "lfm2"
    global_names = _LFM2_GLOBAL_NAMES if lfm2 else _GLOBAL_NAMES
    block_names = _LFM2_BLOCK_NAMES if lfm2 else _BLOCK_NAMES
    if family in GEMMA_FAMILIES:
        block_names = _GEMMA_BLOCK_NAMES
    if gguf_name in global_names:
        return global_names[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in block_names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{block_names[part]}.{kind}"
    raise ModelLoadError(f"{source}: unknown GGUF tensor {gguf_name!r} (not a {family}-family weight)")


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF rotate-half rows -> interleaved pairs); the inverse of ours.

    Kept next to :func:`unpermute_qk` so the round trip is testable against llama.cpp's own formula.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo :func:`permute_qk` on a q/k projection weight or bias (rows = n_head * head_dim)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads")
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """One GGUF tensor, checked: our name, its HF-layout shape and its ggml type name."""

    name: str
    gguf_name: str
    shape: tuple[int, ...]
    ggml_type: str
    index: int  # position in ``reader.tensors``


def plan_weights(file: GGUFFile) -> list[WeightPlan]:
    """Name, shape and type of every tensor, checked before anything is dequantised.

    Raises :class:`ModelLoadError` for an unknown tensor name or an unsupported ggml type (naming both).
    """
    import gguf

    family = family_of(file)
    plans = []
    for index, tensor in enumerate(file.reader.tensors):
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type).name
        if qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{file.path}: tensor {tensor.name!r} uses GGUF type {qtype}, which pagedgen does not "
                f"dequantise (supported: {', '.join(SUPPORTED_TYPES)})"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the innermost dimension first
        name = our_tensor_name(tensor.name, file.path, family)
        if name.endswith(_LFM2_CONV) and len(shape) == 2:
            shape = (shape[0], 1, shape[1])
        plans.append(WeightPlan(name, tensor.name, shape, qtype, index))
    return plans


def dequantize_weight(file: GGUFFile, plan: WeightPlan, config: ModelConfig) -> np.ndarray:
    """One tensor as a C-contiguous float32 array in HF layout, llama.cpp's Q/K permutation undone."""
    import gguf

    tensor = file.reader.tensors[plan.index]
    values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[plan.ggml_type])
    if values.size != int(np.prod(plan.shape)):
        raise ModelLoadError(
            f"{file.path}: tensor {plan.gguf_name!r} holds {values.size} values, its shape says {plan.shape}"
        )
    values = values.reshape(plan.shape)
    if file.architecture == "llama":  # llama.cpp permutes Q/K rows only for its llama arch
        if plan.name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_qk(values, config.num_heads)
        elif plan.name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_qk(values, config.num_kv_heads)
    elif config.architecture in GEMMA_FAMILIES and plan.name.endswith("norm.weight"):
        values = values - np.float32(1.0)  # llama.cpp stored Gemma's 1 + weight
    values = np.ascontiguousarray(values, dtype=np.float32)
    return values if values.flags.writeable else values.copy()  # F32 data is a read-only view of the file
