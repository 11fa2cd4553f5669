"""Builders of tiny checkpoints for model and loader tests: random HF models and GGUF files written from them.

The GGUF writer here is deliberately independent of pagedgen's reader: its name table and Q/K permutation
are copied from llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``), so a test that writes with
this module and reads with pagedgen checks pagedgen against llama.cpp, not against itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

TINY = dict(
    vocab_size=260,  # 256 byte-level tokens + one merge + 3 specials, so the GGUF tokenizer is complete
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
)

# HF name part -> llama.cpp tensor name part (llama.cpp gguf-py tensor_mapping.py).
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GGUF_GLOBAL["lm_head.weight"] = "output.weight"

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama_cpp_rope_factors(rope: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for llama3 rope scaling (its formula)."""
    import math

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def tiny_config(kind: str, **overrides: Any):
    """A transformers config: ``llama``, ``llama3``, ``mistral``, ``qwen2``, ``qwen3``, ``lfm2``, ``gemma2``,
    ``gemma3`` (Gemma 3 text), ``bamba`` or ``granitemoehybrid``."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    args = {**TINY, **overrides}
    if kind == "lfm2":  # short convolutions mixed with attention; the MLP width is taken as given
        from transformers import Lfm2Config

        base = {k: v for k, v in TINY.items() if k != "head_dim"}  # hidden / heads, as LFM2 derives it
        layers = ["conv", "full_attention", "conv", "conv"]
        defaults = dict(
            num_hidden_layers=4, layer_types=layers, conv_L_cache=3, block_auto_adjust_ff_dim=False
        )
        return Lfm2Config(**{**base, **defaults, **overrides})
    if kind in ("gemma2", "gemma3"):
        return _tiny_gemma_config(kind, overrides)
    if kind == "bamba":  # Mamba-2 mixers mixed with attention; two B/C groups, a 4-tap convolution
        from transformers import BambaConfig

        base = {k: v for k, v in TINY.items() if k != "head_dim"}  # hidden / heads, as Bamba derives it
        defaults = dict(
            num_hidden_layers=4,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=2,
        )
        return BambaConfig(**{**base, **defaults, **overrides})
    if (
        kind == "granitemoehybrid"
    ):  # the same mixers, dense MLP, Granite's multipliers, attention without RoPE
        from transformers import GraniteMoeHybridConfig

        base = {k: v for k, v in TINY.items() if k not in ("head_dim", "intermediate_size")}
        defaults = dict(
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            num_local_experts=0,
            shared_intermediate_size=96,
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=2,
            embedding_multiplier=1.5,
            residual_multiplier=0.7,
            attention_multiplier=0.2,
            logits_scaling=2.5,
            position_embedding_type="nope",
        )
        return GraniteMoeHybridConfig(**{**base, **defaults, **overrides})
    if kind == "llama":
        return LlamaConfig(**args)
    if kind == "llama3":
        rope = dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0
        )
        rope["original_max_position_embeddings"] = 64
        return LlamaConfig(rope_parameters=rope, **args)
    if kind == "mistral":
        return MistralConfig(**{"sliding_window": None, **args})
    if kind == "qwen2":
        return Qwen2Config(**args)
    if kind == "qwen3":
        return Qwen3Config(**{**args, "head_dim": 32})  # head_dim != hidden / heads, as in real Qwen3
    raise ValueError(kind)


def _tiny_gemma_config(kind: str, overrides: dict[str, Any]):
    """Gemma 2 / Gemma 3 text with every trait visible at this size: a window of 8 over four layers mixing
    local and global, a query scale other than the head size, soft-caps that bend the scores and logits,
    and (Gemma 3) a local RoPE base apart from the global layers' linearly scaled one."""
    from transformers import Gemma2Config, Gemma3TextConfig

    base = dict(
        TINY,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        sliding_window=8,
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
    )
    if kind == "gemma2":
        return Gemma2Config(**{**base, "attn_logit_softcapping": 1.0, **overrides})
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
    }
    return Gemma3TextConfig(**{**base, "rope_parameters": rope, **overrides})


def tiny_hf_model(kind: str, seed: int = 0, **overrides: Any):
    """A random float32 transformers model; norms and biases randomised too, so a comparison sees them.

    Norm scales land in [0.5, 1.5] for every family: Gemma's RMSNorm scales by ``1 + weight``, so its
    weights are drawn around 0.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                low = -0.5 if kind.startswith("gemma") else 0.5
                param.uniform_(low, low + 1.0)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith((".D", ".dt_bias")):  # Mamba-2's: transformers initialises them to ones
                param.uniform_(0.5, 1.5)
    return model


def hf_state(model) -> dict[str, np.ndarray]:
    """The model's tensors as float32 numpy arrays, HF names (tied head omitted, as checkpoints do)."""
    state = {name: t.detach().float().numpy().copy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module path>.<weight|bias>
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"


def byte_level_vocab() -> tuple[list[str], list[int]]:
    """256 byte-level tokens (GPT-2 alphabet), the merge ``h e``, then the specials.

    Token types: 1 = normal, 3 = control.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "he", *SPECIALS]
    return tokens, [1] * 257 + [3] * len(SPECIALS)


def add_byte_level_tokenizer(writer) -> list[str]:
    """Write :func:`byte_level_vocab` as a GPT-2 BPE tokenizer (the one merge ``h e``), as every test GGUF
    carries it; returns the token list (for the special ids)."""
    tokens, types = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e"])
    return tokens


def finish_gguf(writer) -> None:
    """Write the header, the metadata and the tensors, in the order gguf's writer requires, and close."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(
    path: Path,
    arch: str,
    tensors: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    qtype: Any = None,
    tokenizer: bool = True,
    rope_freqs: np.ndarray | None = None,
    sliding_window: int | None = None,
) -> None:
    """Write a GGUF file like llama.cpp's converter: metadata, byte-level tokenizer, named tensors.

    ``tensors`` use HF names; q/k rows are permuted for the ``llama`` arch. 2-D weights are stored as
    ``qtype`` (default F32; or a callable of the HF name, for a file mixing formats as llama.cpp's recipes
    do); 1-D tensors stay F32, as llama.cpp keeps norms and biases. ``sliding_window``
    writes ``{arch}.attention.sliding_window`` (llama.cpp's key; its converter writes it for the families
    it runs windowed).
    """
    import gguf

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if tokenizer:
        tokens = add_byte_level_tokenizer(writer)
        writer.add_bos_token_id(tokens.index("<|im_start|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.ascontiguousarray(rope_freqs, dtype=np.float32))
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype=np.float32)
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, heads, heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, heads, kv_heads)
        chosen = (
            gguf.GGMLQuantizationType.F32 if data.ndim != 2 else qtype(name) if callable(qtype) else qtype
        )
        add_tensor(writer, gguf_name(name), data, chosen)
    finish_gguf(writer)


def add_tensor(writer, name: str, data: np.ndarray, qtype) -> None:
    """Quantise ``data`` to ``qtype`` with gguf's own quantiser and add it to ``writer``.

    The K-quants, which gguf-py cannot quantise, are written as random valid blocks of ``data``'s shape
    (:func:`random_k_blocks`, seeded by the name): the file's values then are not ``data``'s, so a test
    compares against a reader of the file.
    """
    import gguf

    if qtype.name in K_QUANT_SCALES:
        seed = sum(name.encode())
        writer.add_tensor(name, random_k_blocks(qtype.name, data, seed), raw_dtype=qtype)
        return
    quantized = gguf.quants.quantize(data, qtype)
    raw = None if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else qtype
    writer.add_tensor(name, quantized, raw_dtype=raw)


# K-quant super-blocks: (bytes, ((offset of an f16 scale, its largest multiplier), ...)): d times the
# largest sub-scale times the largest q (or dmin times the largest min) spans the values' amplitude.
K_QUANT_SCALES = {
    "Q2_K": (84, ((80, 15 * 3), (82, 15 * 2))),
    "Q3_K": (110, ((108, 32 * 4),)),
    "Q4_K": (144, ((0, 63 * 15), (2, 63 * 2))),
    "Q5_K": (176, ((0, 63 * 31), (2, 63 * 2))),
    "Q6_K": (210, ((208, 128 * 32),)),
}


def random_k_blocks(qtype: str, data: np.ndarray, seed: int) -> np.ndarray:
    """``[rows, row_bytes]`` random K-quant blocks for a ``[rows, k]`` tensor, their scales finite and sized
    so the values span about three standard deviations of ``data`` (a model that stays numerically tame)."""
    block_bytes, scales = K_QUANT_SCALES[qtype]
    rows, k = data.shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, k // 256, block_bytes), dtype=np.uint8)
    amplitude = 3 * float(data.std()) + 1e-3
    for offset, largest in scales:
        jitter = rng.uniform(0.5, 1.0, (rows, k // 256, 1))
        blocks[..., offset : offset + 2] = (amplitude / largest * jitter).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def hf_config_dict(model) -> dict[str, Any]:
    """The numbers :func:`write_gguf` needs, from a transformers model's config."""
    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    return dict(
        max_position_embeddings=c.max_position_embeddings,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=rope.get("rope_theta", 10000.0),
        vocab_size=c.vocab_size,
    )


# A tiny Llama config.json written by hand (no transformers import), for loader and error tests.
TINY_RAW: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    **{k: v for k, v in TINY.items() if k != "initializer_range"},
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def random_state(raw: Mapping[str, Any], seed: int = 0, qkv_bias: bool = False, qk_norm: bool = False):
    """Random float32 weights with HF names and shapes for the config dict ``raw``."""
    rng = np.random.default_rng(seed)
    hidden, inner, vocab = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    heads, kv_heads, head_dim = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]

    def w(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    state = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": 1 + w(hidden)}
    if not raw.get("tie_word_embeddings", False):
        state["lm_head.weight"] = w(vocab, hidden)
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + w(hidden)
        state[p + "post_attention_layernorm.weight"] = 1 + w(hidden)
        for name, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            state[p + f"self_attn.{name}_proj.weight"] = w(rows, hidden)
            if qkv_bias:
                state[p + f"self_attn.{name}_proj.bias"] = w(rows)
        state[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        if qk_norm:
            state[p + "self_attn.q_norm.weight"] = 1 + w(head_dim)
            state[p + "self_attn.k_norm.weight"] = 1 + w(head_dim)
        state[p + "mlp.gate_proj.weight"] = w(inner, hidden)
        state[p + "mlp.up_proj.weight"] = w(inner, hidden)
        state[p + "mlp.down_proj.weight"] = w(hidden, inner)
    return state


def write_hf_dir(path: Path, raw: Mapping[str, Any], state: Mapping[str, np.ndarray]) -> Path:
    """An HF checkpoint dir: ``config.json`` + one ``model.safetensors``."""
    import json

    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(raw)))
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def write_gemma_gguf(
    path: Path,
    model,
    pattern: list[bool] | None = None,
    local_base: float | None = None,
    replace: Mapping[str, Any] | None = None,
    qtype: Any = None,
) -> None:
    """Gemma 2 / Gemma 3 text as llama.cpp's ``convert_hf_to_gguf.py`` (``Gemma2Model``, ``Gemma3Model``)
    writes them: arch ``gemma2`` / ``gemma3``, names from gguf's own tensor map, every ``*norm.weight`` stored
    plus one, no Q/K permutation, the tied head left out. Gemma 2 writes its soft-caps and window but no RoPE
    base; Gemma 3 writes the global layers' RoPE base and linear scaling, its final soft-cap when set and the
    window. The layer pattern and the local RoPE base are llama.cpp's rules unless ``pattern`` (one flag per
    layer, True = sliding) or ``local_base`` (``rope.freq_base_swa``) are given. ``replace`` sets
    ``<arch>.<key>`` metadata (ints as uint32, floats as float32, lists as arrays) for refusal tests.
    ``qtype`` (a callable of the HF name) stores 2-D weights in other formats than F32."""
    import gguf

    c = model.config
    arch = "gemma2" if c.model_type == "gemma2" else "gemma3"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        rope = c.rope_parameters["full_attention"]
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        if c.final_logit_softcapping:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    writer.add_sliding_window(c.sliding_window)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    if local_base is not None:
        writer.add_rope_freq_base_swa(local_base)
    for key, value in (replace or {}).items():
        name = f"{arch}.{key}"
        writer.kv_data[0].pop(name, None)
        if isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    add_byte_level_tokenizer(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, array in hf_state(model).items():
        if name == "lm_head.weight":
            continue  # the converter skips it: Gemma ties its head
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # Gemma's RMSNorm scales by 1 + weight
        gguf_tensor = names.get_name(name, try_suffixes=(".weight", ".bias"))
        chosen = qtype(name) if qtype is not None and array.ndim == 2 else gguf.GGMLQuantizationType.F32
        add_tensor(writer, gguf_tensor, array, chosen)
    finish_gguf(writer)


def formats_by_suffix(formats: Mapping[str, Any], default: Any) -> Any:
    """A ``qtype`` callable for the GGUF writers: the format of the first ``formats`` HF-name suffix a
    tensor's name ends with (``{"v_proj.weight": Q8_0, ...}``, a llama.cpp mix), else ``default``."""
    return lambda name: next((q for suffix, q in formats.items() if name.endswith(suffix)), default)
