"""A request's parameters as callers write them: ``SamplingParams`` and its output constraint.

This is the one typed object a request's parameters travel in: ``pg.LLM``, ``ChatSession`` and the
server's request bodies build a :class:`SamplingParams` (validated once, here, by the one rule set of
:mod:`pagedgen.sampling.options`), and the engine takes it as it is (``GeneratorParams.set_sampling_params``,
whose request-level part is :meth:`SamplingParams.sampling_options`). ``set_search_options(**kwargs)``
stays as the ONNX Runtime GenAI-compatible way to set the same options by name. docs/engine.md,
"Validation at the boundary", has the rules.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedgen.errors import GuidanceError, SamplingOptionsError
from pagedgen.sampling.options import (
    SamplingOptions,
    check_num_logprobs,
    check_stop_strings,
    is_int,
    is_real,
)

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# SamplingOptions' field names that SamplingParams calls differently.
_PARAM_NAME = {"min_new_tokens": "min_tokens", "do_sample": "temperature"}
# The sampling filters a greedy request leaves at their neutral values (greedy decoding ignores them).
_NEUTRAL_WHEN_GREEDY = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
# JSON Schema as a dict, or any other guidance's text.
GuidanceData = dict[str, object] | str


def choice_grammar(choices: Sequence[str]) -> str:
    """A Lark grammar (llguidance's dialect) matching exactly one of ``choices``, nothing more.

    Each choice is a JSON-escaped string literal (llguidance reads Lark literals with JSON escapes), so
    quotes, backslashes, newlines, ``|`` and non-ASCII text match literally, never as grammar syntax.
    """
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain a completion's text (vLLM's ``StructuredOutputsParams``); set exactly one field.

    - ``json``: a JSON Schema, as a dict or as JSON text; the output is JSON valid against it, written as
      ``json.dumps`` writes it;
    - ``regex``: a regular expression the whole output matches (llguidance's Rust ``regex`` syntax);
    - ``choice``: a non-empty list of strings; the output is exactly one of them;
    - ``grammar``: a Lark grammar in llguidance's dialect (``start`` is the root rule);
    - ``json_object=True``: any JSON object.

    The constraint is compiled here, so a schema, regex or grammar that llguidance refuses raises
    :class:`SamplingOptionsError` now, naming the field (``field`` is ``"structured_outputs.<name>"``).
    """

    json: Mapping[str, object] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in _CONSTRAINTS if self._is_set(name)]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise SamplingOptionsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object=True; got {found}",
                "structured_outputs",
            )
        name = given[0]
        self._check_types(name)
        from pagedgen.guidance import compile_guidance  # llguidance: only once constrained

        try:
            compile_guidance(*self.guidance())
        except GuidanceError as exc:
            raise SamplingOptionsError(
                f"structured_outputs.{name}: {exc}", f"structured_outputs.{name}"
            ) from None

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and not (name == "json_object" and value is False)

    def _check_types(self, name: str) -> None:
        value = getattr(self, name)
        field_name = f"structured_outputs.{name}"
        if name == "json_object" and value is not True:
            raise SamplingOptionsError(f"{field_name} must be true or None, got {value!r}", field_name)
        if name == "json" and not isinstance(value, Mapping | str):
            raise SamplingOptionsError(
                f"{field_name} must be a JSON Schema as a dict or JSON text, got {type(value).__name__}",
                field_name,
            )
        if name in ("regex", "grammar") and not isinstance(value, str):
            raise SamplingOptionsError(f"{field_name} must be a str, got {type(value).__name__}", field_name)
        if name == "choice":
            if isinstance(value, str) or not isinstance(value, Sequence) or not value:
                raise SamplingOptionsError(f"{field_name} must be a non-empty list of strings", field_name)
            bad = next((c for c in value if not isinstance(c, str)), None)
            if bad is not None:
                raise SamplingOptionsError(
                    f"{field_name} must hold only strings, got {type(bad).__name__} {bad!r}", field_name
                )

    @property
    def kind(self) -> str:
        """Which field is set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        return next(name for name in _CONSTRAINTS if self._is_set(name))

    def guidance(self) -> tuple[str, GuidanceData]:
        """The ``(kind, data)`` of ``TurnOptions.set_guidance`` that applies this constraint."""
        kind = self.kind
        if kind == "json":
            schema = self.json
            return "json_schema", dict(schema) if isinstance(schema, Mapping) else str(schema)
        if kind == "json_object":
            return "json_schema", {"type": "object"}
        if kind == "regex":
            return "regex", str(self.regex)
        if kind == "choice":
            return "lark_grammar", choice_grammar(self.choice or ())
        return "lark_grammar", str(self.grammar)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to generate one completion (vLLM's ``SamplingParams`` names; OpenAI semantics).

    ``temperature=0`` is greedy. ``max_tokens=None`` generates until EOS, a stop string or the context ends.
    ``top_k=0`` and ``top_p=1`` disable those filters. ``stop`` strings are never part of the returned text.
    ``logprobs=k`` returns the sampled token's logprob and the top-``k`` alternatives per token.
    ``structured_outputs`` constrains each turn's output (a :class:`StructuredOutputsParams`).
    Raises ``ValueError`` naming the first bad field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        owner = "SamplingParams"
        if not (self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens > 0)):
            raise SamplingOptionsError(
                f"SamplingParams.max_tokens must be None or an int >= 1, got {self.max_tokens!r}",
                "max_tokens",
            )
        check_stop_strings(self.stop, owner, "stop")
        if self.logprobs is not None:
            check_num_logprobs(self.logprobs, owner)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingOptionsError(
                "SamplingParams.structured_outputs must be None or a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}",
                "structured_outputs",
            )
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise SamplingOptionsError(
                f"SamplingParams.logit_bias must be a mapping {{token_id: bias}}, got {self.logit_bias!r}",
                "logit_bias",
            )
        try:
            self._given_options()
        except SamplingOptionsError as exc:  # the one rule set, reported under this class's field names
            name = _PARAM_NAME.get(exc.field or "", exc.field)
            message = str(exc).replace(f"SamplingOptions.{exc.field}", f"{owner}.{name}", 1)
            raise SamplingOptionsError(message, name) from None

    def _given_options(self) -> SamplingOptions:
        """Every field as given (a greedy request's filters too: a bad one is refused all the same)."""
        bias = tuple(self.logit_bias.items()) if self.logit_bias else ()
        if all(is_int(token) for token, _ in bias):
            bias = tuple(sorted(bias))
        return SamplingOptions(
            do_sample=is_real(self.temperature) and self.temperature > 0,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            ignore_eos=self.ignore_eos,
            min_new_tokens=self.min_tokens,
        )

    def sampling_options(self) -> SamplingOptions:
        """The engine's :class:`SamplingOptions` of these parameters (what ``GeneratorParams`` carries).

        A greedy request (``temperature=0``) leaves temperature and the top-k / top-p / min-p filters at
        their neutral values: greedy decoding ignores them, and two greedy requests that differ only there
        run the same way (and may continue in the same kept Request).
        """
        options = self._given_options()
        if options.do_sample:
            return options
        return dataclasses.replace(options, **_NEUTRAL_WHEN_GREEDY)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids outside a model's vocabulary (SamplingOptionsError naming ``logit_bias``)."""
        self._given_options().check_vocabulary(vocab_size)
