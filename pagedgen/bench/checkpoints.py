"""The checkpoint directory as the peer systems read it, shared by every baseline runner.

Each baseline (transformers, ONNX Runtime GenAI, vLLM, llama.cpp) loads pagedgen's own checkpoint directory;
what they share about it lives here, so that the module listing the baselines imports the runners and no
runner imports it back.
"""

from __future__ import annotations

import json
from pathlib import Path

NO_CHECKPOINT = "the model has no checkpoint directory (e.g. the synthetic model): nothing for it to load"


def hf_dir_for_loaders(checkpoint_dir: Path, staging: Path) -> Path:
    """``checkpoint_dir`` as other loaders need it: ``architectures`` in ``config.json``, and only HF files.

    ONNX Runtime GenAI's builder and vLLM pick the model class from ``architectures``, which pagedgen's GGUF
    cache entries (written from GGUF metadata) do not carry; transformers' causal-LM table names the class
    for the model type. They also load every ``*.safetensors`` of the folder, and a GGUF entry's
    ``native.safetensors`` (pagedgen's raw weight blocks) is no HF weight file. So unless the folder already
    fits, this returns a copy in ``staging`` that links every other file (no disk cost).
    """
    from pagedgen.models.native_weights import NATIVE_FILE

    config = json.loads((checkpoint_dir / "config.json").read_text())
    native = checkpoint_dir / NATIVE_FILE
    if config.get("architectures") and not native.exists():
        return checkpoint_dir
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = config.get("architectures") or [
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    ]
    if architecture == [None]:
        kind = config.get("model_type")
        raise RuntimeError(f"{checkpoint_dir}: no causal-LM class for model_type {kind!r}")
    staging.mkdir(parents=True)
    for path in checkpoint_dir.iterdir():
        if path.is_file() and path.name not in ("config.json", NATIVE_FILE):
            (staging / path.name).symlink_to(path.resolve())
    (staging / "config.json").write_text(json.dumps(config | {"architectures": architecture}, indent=2))
    return staging
