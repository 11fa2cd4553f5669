"""GGUF test files made as users get them: HF checkpoint -> ``convert_hf_to_gguf.py`` -> ``llama-quantize``.

Why: most GGUF files people download are llama.cpp's K-quant mixes (``Q4_K_M``, ``Q5_K_M``), whose tensors mix
formats inside one layer (Q5_0 / Q8_0 where a row is not a multiple of 256, Q4_K / Q6_K elsewhere). The
default model ships as a Q4_1 file, so to test and benchmark pagedgen on such files this script makes them
with llama.cpp's own tools, from llama.cpp's own source (the one vendored in ``llama-cpp-python``'s sdist,
built by ``scripts/build_llama_cpp.sh``):

* ``smollm2-q4_k_m.gguf`` / ``smollm2-q5_k_m.gguf``: the default model (SmolLM2-135M-Instruct). Its shipped
  Q4_1 file is dequantised to float32 by pagedgen's GGUF cache (an HF safetensors checkpoint with its
  tokenizer), converted to an F32 GGUF and quantized: the weights are the Q4_1 model's, re-quantized.
* ``gemma3-270m-random-q4_k_m.gguf``: a Gemma 3 text model shaped like gemma-3-270m (vocab 262144, hidden 640,
  18 layers, 4 query heads / 1 KV head of 256, MLP 2048, window 512, five local layers to one global) with
  seeded random weights (:func:`pagedgen.bench.random_weights.random_checkpoint`). Its tokenizer is the
  default model's byte-level BPE padded to 262144 entries with tokens no merge can reach: it encodes text as
  the default model does (so llama.cpp's converter recognises its pre-tokenizer) while the vocabulary, and
  so the tied embedding/head, has the real model's size.

Usage (files go to ``--out``; existing outputs are kept unless ``--force``)::

    python scripts/make_quantized_ggufs.py --llama-cpp-src DIR/vendor/llama.cpp --llama-cpp-bin BUILD/bin \
        --out /work/ggufs [--only smollm2 gemma3] [--force]

Every output's per-tensor type mix is printed (gguf's ``GGUFReader``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

THREADS = 2
GEMMA3_VOCAB = 262144
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": GEMMA3_VOCAB,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 1,  # the borrowed tokenizer's ids (the default model's)
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def run(command: list[str], env: dict[str, str] | None = None) -> None:
    """Run a tool, echoing it; raises SystemExit with its output's tail when it fails."""
    print("+ " + " ".join(command), flush=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")


def smollm2_hf_dir(work: Path) -> Path:
    """The default model as an HF checkpoint: pagedgen's fp32 GGUF cache entry plus ``architectures``."""
    from pagedgen.models.checkpoint import default_gguf_path
    from pagedgen.models.gguf_cache import gguf_cache_entry

    entry = gguf_cache_entry(default_gguf_path())
    out = work / "smollm2-hf"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (out / name).symlink_to(entry / name)
    config = json.loads((entry / "config.json").read_text())
    config.pop("pagedgen_source", None)
    (out / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForCausalLM"]}, indent=2))
    return out


def padded_tokenizer(source: Path, out: Path, size: int) -> None:
    """``source``'s tokenizer files into ``out``, its BPE vocabulary padded to ``size`` ids.

    The extra entries (``<extra_N>``) are reached by no merge, so every text encodes exactly as before.
    """
    tok = json.loads((source / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    taken = len(vocab) + sum(1 for t in tok.get("added_tokens", []) if t["content"] not in vocab)
    next_id = max(vocab.values()) + 1
    for i in range(size - taken):
        vocab[f"<extra_{i}>"] = next_id + i
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = json.loads((source / "tokenizer_config.json").read_text())
    # The plain fast tokenizer: for a gemma3 config transformers would otherwise pick Gemma's class, which
    # adds its own special tokens past the vocabulary.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def gemma3_hf_dir(work: Path, seed: int) -> Path:
    """A random-weight gemma-3-270m-shaped checkpoint (fp32) with a 262144-entry tokenizer."""
    from pagedgen.bench.random_weights import random_checkpoint

    config_dir = work / "gemma3-270m-config"
    shutil.rmtree(config_dir, ignore_errors=True)
    config_dir.mkdir(parents=True)
    (config_dir / "config.json").write_text(json.dumps(GEMMA3_270M, indent=2))
    padded_tokenizer(smollm2_hf_dir(work), config_dir, GEMMA3_VOCAB)
    out = work / "gemma3-270m-random-hf"
    shutil.rmtree(out, ignore_errors=True)
    return random_checkpoint(config_dir, out, seed=seed)


def convert(src: Path, hf_dir: Path, out: Path) -> None:
    """llama.cpp's own converter (its vendored ``gguf-py`` first on the path), F32 output.

    It imports ``sentencepiece`` even for BPE tokenizers (llama.cpp's converter requirements): install it
    where ``PYTHONPATH`` finds it, e.g. ``pip install --target DIR sentencepiece``."""
    path = [str(src / "gguf-py"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(path)}
    script = str(src / "convert_hf_to_gguf.py")
    run([sys.executable, script, str(hf_dir), "--outtype", "f32", "--outfile", str(out)], env=env)


def quantize(bin_dir: Path, source: Path, out: Path, kind: str) -> None:
    run([str(bin_dir / "llama-quantize"), str(source), str(out), kind, str(THREADS)])


def type_mix(path: Path) -> dict[str, dict[str, int]]:
    """Per tensor role (``blk.N.`` dropped): how many tensors of each GGML type."""
    from gguf import GGUFReader

    mix: dict[str, Counter[str]] = {}
    for tensor in GGUFReader(path).tensors:
        role = re.sub(r"^blk\.\d+\.", "", tensor.name)
        mix.setdefault(role, Counter())[tensor.tensor_type.name] += 1
    return {role: dict(sorted(types.items())) for role, types in mix.items()}


def print_mix(path: Path) -> None:
    size = path.stat().st_size
    print(f"\n{path.name}: {size / 2**20:.1f} MiB")
    for role, types in type_mix(path).items():
        print(f"  {role:<28} " + ", ".join(f"{t} x{n}" for t, n in types.items()))


def make(name: str, args: argparse.Namespace) -> list[Path]:
    """Build one model's quantized files (kept when present, unless ``--force``); returns their paths."""
    kinds = {"smollm2": ("Q4_K_M", "Q5_K_M"), "gemma3": ("Q4_K_M",)}[name]
    stem = {"smollm2": "smollm2", "gemma3": "gemma3-270m-random"}[name]
    outs = [args.out / f"{stem}-{k.lower()}.gguf" for k in kinds]
    if all(p.is_file() for p in outs) and not args.force:
        print(f"{name}: kept {', '.join(p.name for p in outs)} (--force rebuilds)")
        return outs
    work = args.out / "work"
    f32 = work / f"{stem}-f32.gguf"
    if not f32.is_file() or args.force:  # one left by --keep-work is reused
        hf_dir = smollm2_hf_dir(work) if name == "smollm2" else gemma3_hf_dir(work, args.seed)
        convert(args.llama_cpp_src, hf_dir, f32)
    for kind, out in zip(kinds, outs, strict=True):
        quantize(args.llama_cpp_bin, f32, out, kind)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return outs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp-src", type=Path, required=True, help="llama.cpp's source folder")
    p.add_argument("--llama-cpp-bin", type=Path, required=True, help="directory holding llama-quantize")
    p.add_argument("--out", type=Path, default=Path("/work/ggufs"))
    p.add_argument("--only", nargs="+", choices=("smollm2", "gemma3"), default=["smollm2", "gemma3"])
    p.add_argument("--seed", type=int, default=0, help="seed of the random Gemma 3 weights")
    p.add_argument("--force", action="store_true", help="rebuild files that exist")
    p.add_argument(
        "--keep-work", action="store_true", help="keep OUT/work (HF dirs, F32 GGUFs: reused next time)"
    )
    args = p.parse_args()
    for path, what in ((args.llama_cpp_src / "convert_hf_to_gguf.py", "converter"),
                       (args.llama_cpp_bin / "llama-quantize", "llama-quantize")):  # fmt: skip
        if not path.is_file():
            raise SystemExit(f"no {what} at {path}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only:
        for path in make(name, args):
            print_mix(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
