"""Issue 11, item 4 on the default model: a stop string that begins inside a generated token.

Greedy, "The three primary colors are" continues " the" " primary" " colors" ...; OpenAI and vLLM return
the text exactly up to the stop string, so stop "rim" gives " the p" (not " the", the text before the token
" primary" in which "rim" begins), from the server streaming or not and from ``pg.LLM``.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from tests.server.live import MODEL_NAME

pytestmark = pytest.mark.model

PROMPT = "The three primary colors are"
CASES = [("rim", " the p"), ("he p", " t"), (" primary", " the")]


@pytest.mark.parametrize("stop, expected", CASES)
def test_text_ends_exactly_at_a_stop_string_inside_a_token(client, reference_llm, stop, expected):
    params = pg.SamplingParams(max_tokens=10, temperature=0.0, stop=(stop,))
    [out] = reference_llm.generate(PROMPT, params, use_tqdm=False)
    assert (out.text, out.finish_reason, out.stop_reason) == (expected, "stop", stop)
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop]
    )
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected, "stop")
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
