"""The ingress of the replicated application reads the model's card, never its weights: the card of a
checkpoint matches what the loaded model reports, and the ingress's app is built with every weight loader
refused."""

from __future__ import annotations

import pytest

import pagedgen.models.model as model_module
from pagedgen.guidance.tokenizer import guidance_tokenizer
from pagedgen.llm import ModelView, SamplingParams, context_length, generator_params
from pagedgen.models.model import Model
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer
from pagedgen.server.app import ServerOptions
from pagedgen.server.replicas.application import ingress_app
from pagedgen.server.replicas.setup import SYNTHETIC, ModelCard, ModelSource, ReplicaSetup
from tests.model.tiny_checkpoints import TINY_RAW, random_state, write_gguf

CHAT = [{"role": "user", "content": "héllo"}]


class WeightsLoaded(AssertionError):
    pass


def _refuse(*_args, **_kwargs):
    raise WeightsLoaded("the ingress loaded the model's weights")


@pytest.fixture
def no_weights(monkeypatch):
    """Every way of loading a model's weights raises (the whole model, its tensors, the source's load)."""
    for name in ("load_weights", "read_hf_weights", "read_native_entry"):
        monkeypatch.setattr(model_module, name, _refuse)
    monkeypatch.setattr(Model, "__init__", _refuse)
    monkeypatch.setattr(ModelSource, "load", _refuse)
    monkeypatch.setattr(SyntheticModel, "forward", _refuse)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", random_state(TINY_RAW, seed=3), TINY_RAW)
    return str(path)


def test_a_checkpoint_card_says_what_the_loaded_model_says(tiny_gguf, monkeypatch):
    with monkeypatch.context() as patch:
        for name in ("load_weights", "read_hf_weights", "read_native_entry"):
            patch.setattr(model_module, name, _refuse)
        patch.setattr(Model, "__init__", _refuse)
        card = ModelSource(tiny_gguf).describe()
    model = Model(tiny_gguf, device="cpu")
    assert (card.vocab_size, card.max_context, card.eos_token_ids) == (
        model.vocab_size,
        model.max_context,
        model.eos_token_ids,
    )
    assert card.eos_token_ids == (model.tokenizer.token_to_id("<|im_end|>"),)
    assert card.tokenizer.encode("héllo wörld") == model.tokenizer.encode("héllo wörld")
    assert card.tokenizer.apply_chat_template(CHAT) == model.tokenizer.apply_chat_template(CHAT)


def test_the_ingress_builds_its_app_without_the_weights(tiny_gguf, no_weights):
    setup = ReplicaSetup(source=ModelSource(tiny_gguf), options=ServerOptions(model_name="tiny"))
    worker, app = ingress_app(None, setup, "pagedgen")
    card = worker.model
    assert isinstance(card, ModelCard)
    assert app.state.worker is worker
    assert context_length(card) == TINY_RAW["max_position_embeddings"]
    assert card.vocab_size == TINY_RAW["vocab_size"]
    # the checks the routes make off the engine take the card: the parameters' and guidance's tokenizer
    params = generator_params(card, SamplingParams(max_tokens=4))
    assert params.max_length == TINY_RAW["max_position_embeddings"]
    assert guidance_tokenizer(card).vocab_size == TINY_RAW["vocab_size"]


def test_the_synthetic_card_is_the_synthetic_model_s(no_weights):
    card = ModelSource(SYNTHETIC, vocab_size=95).describe()
    model = SyntheticModel(vocab_size=95)
    assert (card.vocab_size, card.max_context, card.eos_token_ids) == (95, model.max_context, ())
    assert isinstance(card.tokenizer, SyntheticTokenizer)
    assert card.tokenizer.encode("abc") == SyntheticTokenizer(95).encode("abc")
    template = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    chat = ModelSource(SYNTHETIC, vocab_size=95, chat_template=template).describe()
    assert chat.tokenizer.apply_chat_template(CHAT, add_generation_prompt=False) == "héllo|"


def test_the_card_and_both_models_fill_the_servers_model_view(tiny_gguf):
    """What the server reads of a model (``ModelView``) the ingress's card has, as the models do."""
    members = [name for name in ModelView.__dict__ if not name.startswith("_")]
    assert members == ["vocab_size", "max_context", "eos_token_ids", "tokenizer"]
    views = [ModelSource(tiny_gguf).describe(), ModelSource(SYNTHETIC).describe()]
    views += [Model(tiny_gguf, device="cpu"), SyntheticModel()]
    for view in views:
        assert isinstance(view.vocab_size, int) and isinstance(view.max_context, int), view
        assert isinstance(view.eos_token_ids, tuple) and all(isinstance(i, int) for i in view.eos_token_ids)
        assert view.tokenizer.decode(view.tokenizer.encode("ab")) == "ab", view
