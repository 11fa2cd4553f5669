"""The GGUF weight cache: sha256-keyed HF-style entries, warm loads never reopen the GGUF, atomic builds."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import pagedgen.models.gguf_cache as gguf_cache
from pagedgen.core.kv import PagedKVCache
from pagedgen.core.paths import cache_root
from pagedgen.errors import ModelLoadError
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.models.gguf_cache import gguf_cache_entry
from pagedgen.models.model import Model
from pagedgen.models.safetensors_stream import TensorSpec, write_safetensors
from pagedgen.ops.kernels.native import native_status
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf, write_hf_dir


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(root))
    return root


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW, seed=3), TINY_RAW, tokenizer=False)
    return path


def _logits(model: Model, ids: list[int]) -> torch.Tensor:
    """One prefill's logits; the cache and inputs are CPU tensors, so models here load with device="cpu"."""
    cache = PagedKVCache(model.kv_spec, num_blocks=8, block_size=16)
    inputs = pack_step([SequenceChunk(ids, 0, [5, 2, 7], all_logits=True)], block_size=16)
    return model.runtime.forward(inputs, cache)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDGEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "pagedgen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagedgen"
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"


def test_first_load_builds_a_sha256_keyed_entry_and_later_loads_never_reopen_the_gguf(
    cache_dir, tiny_gguf, monkeypatch
):
    cold = Model(str(tiny_gguf), device="cpu")
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    entry = cache_dir / f"gguf-v{gguf_cache.CACHE_FORMAT}" / digest
    assert cold.checkpoint_dir == entry
    names = sorted(p.name for p in entry.iterdir())
    assert names == ["config.json", "model.safetensors", "native.safetensors"]  # no vocab in the file
    assert [p.name for p in entry.parent.iterdir()] == [digest]  # no temporary directory left behind

    def no_reopen(path):
        raise AssertionError(f"warm load reopened {path}")

    monkeypatch.setattr(gguf_cache, "open_gguf", no_reopen)
    warm = Model(str(tiny_gguf), device="cpu")
    ids = list(range(0, 260, 7))
    assert torch.equal(_logits(warm, ids), _logits(cold, ids))


def test_entry_matches_the_same_weights_loaded_from_an_hf_dir(cache_dir, tiny_gguf, tmp_path):
    """F32 GGUF (permuted Q/K, llama.cpp names) and the HF dir of the same weights give identical logits."""
    hf_dir = write_hf_dir(tmp_path / "hf", TINY_RAW, random_state(TINY_RAW, seed=3))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    assert torch.equal(
        _logits(Model(str(tiny_gguf), device="cpu"), ids), _logits(Model(str(hf_dir), device="cpu"), ids)
    )


def test_editing_the_file_makes_a_new_entry(cache_dir, tiny_gguf):
    first = gguf_cache_entry(tiny_gguf)
    state = random_state(TINY_RAW, seed=4)
    write_gguf(tiny_gguf, "llama", state, TINY_RAW, tokenizer=False)
    second = gguf_cache_entry(tiny_gguf)
    assert first != second and first.is_dir() and second.is_dir()
    stored = load_file(second / "model.safetensors")
    np.testing.assert_array_equal(
        stored["model.layers.1.mlp.up_proj.weight"].numpy(), state["model.layers.1.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize(
    ("weights", "damaged"), [("float32", "model.safetensors"), ("native", "native.safetensors")]
)
def test_a_damaged_entry_is_rebuilt(cache_dir, tiny_gguf, weights, damaged):
    entry = gguf_cache_entry(tiny_gguf)
    path = entry / damaged
    intact = path.read_bytes()
    path.write_bytes(intact[: len(intact) // 2])
    model = Model(str(tiny_gguf), device="cpu", weights=weights)
    assert model.checkpoint_dir == entry and path.read_bytes() == intact


def test_half_precision_tensors_are_kept_lossless(cache_dir, tmp_path):
    path = tmp_path / "f16.gguf"
    write_gguf(
        path,
        "llama",
        random_state(TINY_RAW, seed=5),
        TINY_RAW,
        qtype=gguf.GGMLQuantizationType.F16,
        tokenizer=False,
    )
    entry = gguf_cache_entry(path)
    with safe_open(entry / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "F16"
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"  # 1-D tensors were written F32
    config = json.loads((entry / "config.json").read_text())
    assert config["pagedgen_source"] == {"gguf": str(path), "sha256": entry.name}


def test_refused_file_writes_nothing(cache_dir, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        gguf_cache_entry(path)
    assert not cache_dir.exists() or not any(cache_dir.rglob("*"))


def test_streamed_safetensors_round_trip(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.float16),
        "c": torch.randn(2, 2, 2).to(torch.bfloat16),
    }
    specs = [TensorSpec("a", "F32", (3, 5)), TensorSpec("b", "F16", (7,)), TensorSpec("c", "BF16", (2, 2, 2))]
    write_safetensors(tmp_path / "x.safetensors", specs, iter(tensors.items()), {"k": "v"})
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[name], tensor) for name, tensor in tensors.items())
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"k": "v"}


def test_streamed_safetensors_refuses_mismatches(tmp_path):
    spec = [TensorSpec("a", "F32", (2,))]
    with pytest.raises(ValueError, match="does not match spec"):
        write_safetensors(tmp_path / "x.safetensors", spec, iter([("a", torch.zeros(3))]))
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "y.safetensors", spec, iter([]))
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("a", "I64", (2,))


def test_a_freshly_built_entry_that_fails_to_load_is_not_rebuilt(cache_dir, tmp_path, monkeypatch):
    path = tmp_path / "mismatch.gguf"
    write_gguf(path, "llama", random_state({**TINY_RAW, "vocab_size": 250}), TINY_RAW, tokenizer=False)
    builds = []
    real_build = gguf_cache._build_entry
    monkeypatch.setattr(
        gguf_cache, "_build_entry", lambda src, entry: (builds.append(entry), real_build(src, entry))
    )
    with pytest.raises(ModelLoadError, match="vocab mismatch: the token embedding has 250 rows"):
        Model(str(path), device="cpu")
    assert len(builds) == 1  # the file itself is wrong: rebuilding the entry would not help


def test_losing_the_publish_race_keeps_the_winners_entry(tmp_path):
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "config.json").write_text("winner")
    tmp = tmp_path / ".tmp-loser"
    tmp.mkdir()
    (tmp / "config.json").write_text("loser")
    gguf_cache._publish(tmp, entry)  # another process renamed its copy first: no error, theirs stays
    assert (entry / "config.json").read_text() == "winner"


@pytest.fixture
def in_child(cache_dir, monkeypatch):
    """Every file is built in a child process, and this process cannot parse a GGUF file or build a
    tokenizer: a cold load that works proves the parse happened elsewhere. The kernels this process
    loaded are put in the fresh cache, so the child does not compile them again."""
    status = native_status()
    if status.available:
        library = Path(status.detail)
        kept = cache_dir / "kernels" / library.name
        kept.parent.mkdir(parents=True, exist_ok=True)
        if library != kept:
            shutil.copy(library, kept)
    monkeypatch.setattr(gguf_cache, "CHILD_BUILD_MIN_BYTES", 0)

    def refused(*args):
        raise AssertionError(f"the parent process parsed {args[0]}")

    for name in ("open_gguf", "gguf_tokenizer_files", "build_entry_here"):
        monkeypatch.setattr(gguf_cache, name, refused)


def test_a_child_builds_the_same_entry_and_this_process_never_parses_the_file(
    cache_dir, tmp_path, in_child, monkeypatch
):
    path = tmp_path / "vocab.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW, seed=6), TINY_RAW, qtype=gguf.GGMLQuantizationType.Q8_0)
    model = Model(str(path), device="cpu")
    assert model.checkpoint.built
    child_entry = model.checkpoint_dir
    monkeypatch.undo()  # this process may parse again: the same entry built here, under another root
    here_entry = gguf_cache.gguf_cache_dir(path, tmp_path / "here")
    gguf_cache.build_entry_here(path, here_entry)
    names = sorted(p.name for p in child_entry.iterdir())
    assert names == sorted(p.name for p in here_entry.iterdir())
    assert "tokenizer.json" in names and "native.safetensors" in names
    for name in names:
        assert (child_entry / name).read_bytes() == (here_entry / name).read_bytes(), name
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "here"))
    here = Model(str(path), device="cpu")  # a warm load of the entry built here
    assert here.checkpoint_dir == here_entry and not here.checkpoint.built
    ids = list(range(3, 200, 9))
    assert torch.equal(_logits(model, ids), _logits(here, ids))
    assert model.tokenizer.encode("hello world") == here.tokenizer.encode("hello world")


def test_a_refusal_in_the_child_is_raised_here_as_the_same_error(cache_dir, tmp_path, in_child):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="bad.gguf: truncated or corrupt GGUF file"):
        gguf_cache_entry(path)
    assert not (cache_dir / f"gguf-v{gguf_cache.CACHE_FORMAT}").exists() or not any(
        (cache_dir / f"gguf-v{gguf_cache.CACHE_FORMAT}").rglob("*")
    )


def test_a_child_that_dies_is_a_load_error_with_its_output(cache_dir, tiny_gguf, in_child, monkeypatch):
    monkeypatch.setattr(gguf_cache, "_CHILD_CODE", "import sys; sys.exit('killed before building')")
    with pytest.raises(ModelLoadError, match=r"building the weight cache failed \(exit 1\): killed before"):
        gguf_cache_entry(tiny_gguf)
