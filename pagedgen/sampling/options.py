"""Per-request sampling options, and the one set of rules every sampling parameter is validated by.

The field names and defaults follow ``GeneratorParams.set_search_options`` (transformers / ONNX Runtime
GenAI) plus the OpenAI knobs vLLM exposes (presence / frequency penalties, logit bias, ignore_eos).
Validation happens once, here, so the batched sampler never has to check a value on the hot path.

Why one place: the engine options, ``pg.SamplingParams`` and the server's request bodies all end up here
(``SamplingParams`` builds a :class:`SamplingOptions`; the server builds a ``SamplingParams``), and the
per-turn rules (token limit, stop strings, logprobs) are the functions below that ``TurnOptions`` and
``SamplingParams`` share. What needs the loaded model (token ids inside its vocabulary) is
:meth:`SamplingOptions.check_vocabulary`. Every refusal is a :class:`SamplingOptionsError` whose ``field``
names the option.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pagedgen.errors import SamplingOptionsError

SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1  # the range torch.manual_seed accepts; reduced mod 2**64 by the stream
# Bounds on the per-request work of the sampler and the stop matcher (OpenAI's limits where it has one).
MAX_LOGIT_BIAS = 300
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_LOGPROBS = 20
# vLLM's rule: a temperature below this is greedy (dividing logits by it would overflow float32 to inf/NaN).
SAMPLING_EPS = 1e-5
# Repetition penalty divides (or multiplies) logits: outside this range the result is no longer a sane
# distribution, and near 0 it overflows to inf (1e-308 did).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (``True`` and ``False`` are not, though Python counts them as ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a finite number (not a bool, not NaN or an infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _fail(name: str, value: object, rule: str, owner: str = "SamplingOptions") -> SamplingOptionsError:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return SamplingOptionsError(f"{owner}.{name} must be {rule}, got {shown}", field=name)


def check_max_generated_tokens(value: object, owner: str, name: str = "max_generated_tokens") -> None:
    """A turn's token limit: an int >= 0 (0 means only the session limit applies)."""
    if not (is_int(value) and value >= 0):
        raise _fail(name, value, "an int >= 0", owner)


def check_stop_strings(value: object, owner: str, name: str = "stop_strings") -> tuple[str, ...]:
    """Stop strings: a list (not a str) of at most MAX_STOP_STRINGS non-empty strings; returns a tuple."""
    rule = f"a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} chars"
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list):
        raise _fail(name, value, rule, owner)
    stops = tuple(value)
    if len(stops) > MAX_STOP_STRINGS or not all(
        isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops
    ):
        raise _fail(name, value, rule, owner)
    return stops


def check_num_logprobs(value: object, owner: str, name: str = "logprobs") -> None:
    """Top logprobs per token: an int in [0, MAX_LOGPROBS]."""
    if not (is_int(value) and 0 <= value <= MAX_LOGPROBS):
        raise _fail(name, value, f"an int in [0, {MAX_LOGPROBS}]", owner)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How one request turns logits into tokens.

    ``min_length`` counts the whole sequence (prompt + generated, transformers / ORT GenAI semantics),
    ``min_new_tokens`` the tokens generated in the current turn. Presence / frequency penalties follow OpenAI
    (generated tokens only); repetition penalty and no-repeat n-gram follow transformers (whole sequence).
    ``ignore_eos`` does not change the logits (as in vLLM): it tells the engine that an EOS token does not
    finish the turn. A ``temperature`` below :data:`SAMPLING_EPS` (1e-5) is greedy, as in vLLM: ``1e-300``
    means "as cold as possible", and dividing by it would overflow. Raises :class:`SamplingOptionsError`
    naming the first bad field.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    min_p: float = 0.0  # 0.0 = disabled
    seed: int | None = None  # None = a fresh random seed, recorded on the RequestSampler
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    min_new_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("do_sample", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "a bool")
        self._check_real("temperature", lambda v: v >= 0, f">= 0 (below {SAMPLING_EPS:g} means greedy)")
        self._check_int("top_k", 0, "an int >= 0 (0 disables top-k)")
        self._check_real("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1 disables top-p)")
        self._check_real("min_p", lambda v: 0 <= v <= 1, "in [0, 1] (0 disables min-p)")
        if self.seed is not None and not (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise _fail("seed", self.seed, f"None or an int in [{SEED_MIN}, {SEED_MAX}]")
        self._check_real(
            "repetition_penalty",
            lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
            f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 disables it)",
        )
        self._check_int("no_repeat_ngram_size", 0, "an int >= 0 (0 disables it)")
        self._check_int("min_length", 0, "an int >= 0")
        self._check_int("min_new_tokens", 0, "an int >= 0")
        self._check_real("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2] (OpenAI range)")
        self._check_real("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2] (OpenAI range)")
        self._check_logit_bias()

    def _check_real(self, name: str, ok: Callable[[float], bool], rule: str) -> None:
        value = getattr(self, name)
        if not (is_real(value) and ok(value)):
            raise _fail(name, value, f"a finite number {rule}")

    def _check_int(self, name: str, low: int, rule: str) -> None:
        value = getattr(self, name)
        if not (is_int(value) and value >= low):
            raise _fail(name, value, rule)

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        rule = f"at most {MAX_LOGIT_BIAS} (token_id >= 0, bias in [-100, 100]) pairs with distinct token ids"
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            raise _fail("logit_bias", bias, rule)
        for pair in bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and is_int(pair[0]) and pair[0] >= 0):
                raise _fail("logit_bias", bias, rule)
            if not (is_real(pair[1]) and -100 <= pair[1] <= 100):
                raise _fail("logit_bias", bias, rule)
        if len({token for token, _ in bias}) != len(bias):
            raise _fail("logit_bias", bias, rule)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids the loaded model does not have (the rule that needs the model)."""
        outside = sorted(token for token, _ in self.logit_bias if token >= vocab_size)
        if outside:
            raise SamplingOptionsError(
                f"logit_bias names token id(s) {outside[:5]} outside the model's vocabulary "
                f"(valid ids are 0..{vocab_size - 1})",
                field="logit_bias",
            )

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the processed logits (no random draw)."""
        return not self.do_sample or self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def uses_history(self) -> bool:
        """True when repetition penalty or no-repeat n-gram reads the request's token history."""
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0

    @property
    def uses_generated(self) -> bool:
        """True when presence or frequency penalties read the generated tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
