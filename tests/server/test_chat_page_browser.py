"""The chat page at ``/`` in a real browser: headless Chromium driven by Selenium, against live servers of the
synthetic model (loopback only).

The synthetic model's greedy answer is a closed formula of the prompt, and the chat template here is a plain
``role: content`` listing, so each answer the page shows is known exactly. Every wait has a cap (``WAIT_S``)
and waits for a condition, never for time. Chromium and chromedriver are Debian's (``make test`` installs
them); without them these tests fail, they are not skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import threading

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

import pagedgen as pg
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer
from pagedgen.server.app import ServerOptions, build_app
from tests.server.doubles import (
    NUM_BLOCKS,
    VOCAB,
    GatedModel,
    app_state,
    expected_text,
    serve,
    settled_metrics,
)
from tests.server.doubles import wait_until as server_wait_until
from tests.server.live import LiveServer, metric

WAIT_S = 120
KEY = "page-key-42"
MARKDOWN_CHARS = set("*_`[]#<>&\\")  # characters the renderer may turn into markup


class ChatTokenizer(SyntheticTokenizer):
    """The synthetic codec with a chat template: ``role: content`` lines, then ``assistant: ``."""

    def apply_chat_template(self, messages, add_generation_prompt=True, **_variables) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + ("\nassistant: " if add_generation_prompt else "")


TOKENIZER = ChatTokenizer(VOCAB)


def answer_to(messages: list[dict[str, str]], max_tokens: int) -> str:
    """The synthetic model's greedy answer to a conversation."""
    return expected_text(TOKENIZER.encode(TOKENIZER.apply_chat_template(messages)), max_tokens)


def plain_prompt(stem: str, max_tokens: int, before: list[dict[str, str]] = ()) -> str:
    """A user message (``stem``, padded) whose answer holds no markdown character, so the rendered text equals
    the raw text. (The synthetic answer depends on the prompt's first and last tokens and its length.)"""
    for n in range(200):
        text = stem + "!" * n
        answer = answer_to([*before, {"role": "user", "content": text}], max_tokens)
        if not MARKDOWN_CHARS & set(answer) and answer.strip() == answer:
            return text
    raise AssertionError("no plain prompt found")


class StepGate(SyntheticModel):
    """Each forward waits for a permit (``allow(n)``) until ``open()``: the test decides how far it gets."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()

    def allow(self, steps: int) -> None:
        self._permits.release(steps)

    def open(self) -> None:
        self._open.set()
        self._permits.release(1 << 20)

    def forward(self, inputs, kv_cache):
        if not self._open.is_set():
            self._permits.acquire()
        return super().forward(inputs, kv_cache)


# ---------------------------------------------------------------- browser and servers


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver_path, (
        "the browser tests need Debian's chromium and chromium-driver (make test)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in CI
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # loopback only
        "--window-size=1100,800",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # the network requests it made
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server():
    """Keyless on loopback, with the ``Host`` check ``pagedgen serve`` then turns on (DNS rebinding)."""
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=TOKENIZER, allowed_hosts=frozenset())
    yield live
    live.stop()


def open_page(browser, server) -> None:
    """The page, fresh: no history or settings left by an earlier test, the model id fetched."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    until(browser, lambda d: d.find_element(By.ID, "model").text == "synthetic", "the model id is shown")


def until(browser, condition, what: str):
    wait = WebDriverWait(browser, WAIT_S, ignored_exceptions=(StaleElementReferenceException,))
    return wait.until(condition, message=f"never happened: {what}")


def settings(browser, **values: str) -> None:
    """Fill the settings panel (element id -> value), opening it first."""
    if not browser.find_element(By.ID, "settings").is_displayed():
        browser.find_element(By.ID, "settings-toggle").click()
    for field, value in values.items():
        element = browser.find_element(By.ID, field.replace("_", "-"))
        element.clear()
        if value:
            element.send_keys(value)


def say(browser, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def answers(browser):
    return browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")


def finished_answer(browser, count: int):
    """The ``count``-th answer once it has ended (its stats line is shown)."""

    def done(driver):
        found = answers(driver)
        if len(found) < count:
            return False
        answer = found[count - 1]
        ended = "streaming" not in answer.get_attribute("class")
        return answer if ended and answer.find_element(By.CLASS_NAME, "stats").is_displayed() else False

    return until(browser, done, f"answer {count} finished")


def content_of(answer) -> str:
    return answer.find_element(By.CLASS_NAME, "content").text


def error_text(browser) -> str:
    until(browser, lambda d: d.find_element(By.ID, "error").is_displayed(), "an error is shown")
    return browser.find_element(By.ID, "error").text


def stored_history(browser) -> list[dict]:
    stored = browser.execute_script("return localStorage.getItem('pagedgen.chat.history')")
    return [] if stored is None else json.loads(stored)


# ---------------------------------------------------------------- the tests


def test_a_message_streams_the_synthetic_models_exact_answer(browser, server):
    open_page(browser, server)
    settings(browser, temperature="0", max_tokens="24")
    box = browser.find_element(By.ID, "input")
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.NULL, "second line")  # Shift+Enter: a new line
    assert box.get_attribute("value") == "first line\nsecond line" and answers(browser) == []
    box.clear()
    prompt = plain_prompt("Hello", 24)
    say(browser, prompt)
    answer = finished_answer(browser, 1)
    expected = answer_to([{"role": "user", "content": prompt}], 24)
    assert content_of(answer) == expected
    user = browser.find_element(By.CSS_SELECTOR, "#messages .msg.user")
    assert user.text == prompt
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert re.fullmatch(
        r"24 tokens · [\d.]+ tokens/s · cached 0 of \d+ prompt tokens · finish: length", stats
    )
    stored = [(m["role"], m["content"]) for m in stored_history(browser)]
    assert stored == [("user", prompt), ("assistant", expected)]
    assert browser.find_element(By.ID, "input").get_attribute("value") == ""


def test_history_survives_a_reload_and_the_second_turn_reports_cached_tokens(browser, server):
    open_page(browser, server)
    settings(browser, temperature="0", max_tokens="20", system="Be brief.")
    first = plain_prompt("Tell me", 20, [{"role": "system", "content": "Be brief."}])
    say(browser, first)
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": first}]
    reply1 = answer_to(turn1, 20)
    assert content_of(finished_answer(browser, 1)) == reply1

    browser.refresh()
    until(browser, lambda d: len(answers(d)) == 1, "the conversation is restored")
    assert content_of(answers(browser)[0]) == reply1
    assert browser.find_element(By.ID, "system").get_attribute("value") == "Be brief."  # settings too

    before = [*turn1, {"role": "assistant", "content": reply1}]
    second = plain_prompt("And then", 20, before)
    say(browser, second)
    answer = finished_answer(browser, 2)
    assert content_of(answer) == answer_to([*before, {"role": "user", "content": second}], 20)  # multi-turn
    cached = int(answer.find_element(By.CLASS_NAME, "stats").get_attribute("data-cached-tokens"))
    assert cached > 0  # the first turn's blocks came from the prefix cache

    browser.find_element(By.ID, "new").click()
    until(browser, lambda d: answers(d) == [], "the new conversation is empty")
    assert stored_history(browser) == []


def test_stop_ends_the_answer_and_the_server_cancels_the_request(browser):
    model = StepGate(vocab_size=VOCAB)
    live = serve(model, tokenizer=TOKENIZER)
    try:
        open_page(browser, live)
        settings(browser, temperature="0", max_tokens="500")
        say(browser, "Write a long story")
        model.allow(4)  # the prefill and three decode steps: some text streams, then the model waits
        until(browser, lambda d: len(answers(d)) == 1 and content_of(answers(d)[0]) != "", "text streamed")
        assert browser.find_element(By.ID, "stop").is_displayed()
        browser.find_element(By.ID, "stop").click()
        answer = finished_answer(browser, 1)
        assert "stopped" in answer.find_element(By.CLASS_NAME, "stats").text
        disconnects = app_state(live).metrics.disconnects
        server_wait_until(lambda: disconnects._value.get() == 1, "the server noticed the stop")
        model.open()
        text = settled_metrics(live)
        assert metric(text, "pagedgen:request_cancelled_total", model_name="synthetic") == 1
        assert metric(text, "pagedgen:client_disconnects_total", model_name="synthetic") == 1
        assert metric(text, "pagedgen:generation_tokens_total", model_name="synthetic") < 500
        assert metric(text, "pagedgen:kv_cache_blocks_free", model_name="synthetic") == NUM_BLOCKS
        full = answer_to([{"role": "user", "content": "Write a long story"}], 500)
        assert full.startswith(stored_history(browser)[1]["content"])  # what streamed is the answer's start
        assert not browser.find_element(By.ID, "stop").is_displayed()
    finally:
        model.open()
        live.stop()


def test_a_full_server_shows_the_429_message_and_gives_the_text_back(browser):
    model = GatedModel(vocab_size=VOCAB)
    live = serve(model, tokenizer=TOKENIZER, max_batch_size=1, max_queued_requests=0)
    try:
        open_page(browser, live)
        body = {"model": "synthetic", "prompt": [1, 2, 3], "max_tokens": 2}
        with httpx.Client(timeout=WAIT_S) as client:
            occupying = threading.Thread(
                target=client.post, args=(live.url + "/v1/completions",), kwargs={"json": body}
            )
            occupying.start()
            assert model.entered.wait(WAIT_S)  # the one place is taken
            say(browser, "Are you there?")
            message = error_text(browser)
            model.gate.set()
            occupying.join(WAIT_S)
        assert message.startswith("HTTP 429: the server is at capacity (1 requests admitted")
        assert browser.find_element(By.ID, "input").get_attribute("value") == "Are you there?"
        assert answers(browser) == [] and stored_history(browser) == []
        rejected = metric(settled_metrics(live), "pagedgen:request_rejected_total", reason="queue_full")
        assert rejected == 1
    finally:
        model.gate.set()
        live.stop()


def test_a_400_shows_its_message(browser, server):
    open_page(browser, server)
    settings(browser, temperature="7")
    say(browser, "Hi")
    assert re.match(r"HTTP 400: .*temperature", error_text(browser))
    assert browser.find_element(By.ID, "input").get_attribute("value") == "Hi"  # given back
    settings(browser, temperature="0", json_schema="{not json")
    browser.find_element(By.ID, "send").click()
    refused = "The JSON schema in Settings is not valid JSON"
    until(browser, lambda d: d.find_element(By.ID, "error").text.startswith(refused), "the schema refused")
    assert answers(browser) == [] and stored_history(browser) == []


def test_json_schema_setting_constrains_the_answer(browser, server):
    open_page(browser, server)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    settings(browser, temperature="0", max_tokens="60", json_schema=json.dumps(schema))
    say(browser, "a number please")
    answer = finished_answer(browser, 1)
    parsed = json.loads(stored_history(browser)[1]["content"])
    assert set(parsed) == {"n"} and isinstance(parsed["n"], int)
    assert "finish: stop" in answer.find_element(By.CLASS_NAME, "stats").text


def test_a_stopped_server_is_reported(browser):
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=TOKENIZER)
    try:
        open_page(browser, live)
    finally:
        live.stop()
    say(browser, "Hello?")
    assert error_text(browser) == "Cannot reach the server: is `pagedgen serve` still running?"
    assert browser.find_element(By.ID, "input").get_attribute("value") == "Hello?"


class CutAfterEvents:
    """ASGI wrapper that ends each chat-completions stream after its first ``events`` SSE events, with no
    ``[DONE]``: what a client sees when a proxy or the network drops the connection mid-answer."""

    def __init__(self, app, events: int) -> None:
        self.app, self.events = app, events

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        seen, cut = 0, False

        async def cutting_send(message):
            nonlocal seen, cut
            if cut:
                return  # the client's connection is already over: the rest is dropped
            if message["type"] == "http.response.body":
                seen += message.get("body", b"").count(b"data: ")
                if seen >= self.events:
                    cut = True
                    message = {**message, "more_body": False}
            await send(message)

        await self.app(scope, receive, cutting_send)


def test_an_answer_cut_off_before_done_is_reported_and_kept(browser):
    config = pg.EngineConfig(max_batch_size=8, num_blocks=NUM_BLOCKS, debug_invariants=True)
    app = build_app(
        SyntheticModel(vocab_size=VOCAB), config, ServerOptions(model_name="synthetic"), tokenizer=TOKENIZER
    )
    live = LiveServer(CutAfterEvents(app, events=4)).start()
    try:
        open_page(browser, live)
        settings(browser, temperature="0", max_tokens="40")
        say(browser, "Tell me more")
        message = error_text(browser)
        assert message == "The answer was cut off: the connection closed before the server finished it."
        kept = stored_history(browser)
        assert [m["role"] for m in kept] == ["user", "assistant"]
        full = answer_to([{"role": "user", "content": "Tell me more"}], 40)
        assert kept[1]["content"] != "" and full.startswith(kept[1]["content"]) and kept[1]["content"] != full
        assert "streaming" not in answers(browser)[0].get_attribute("class")
        assert not browser.find_element(By.ID, "stop").is_displayed()
    finally:
        live.stop()


def test_the_api_key_flow(browser):
    live = serve(SyntheticModel(vocab_size=VOCAB), tokenizer=TOKENIZER, api_key=KEY)
    try:
        page = httpx.get(live.url + "/")  # the page itself needs no key
        assert page.status_code == 200 and "pagedgen chat" in page.text
        browser.get(live.url + "/")
        browser.execute_script("localStorage.clear()")
        browser.refresh()
        assert error_text(browser) == ("HTTP 401: Incorrect or missing API key (set the API key in Settings)")
        settings(browser, api_key="wrong")
        browser.find_element(By.ID, "input").click()  # the key field's change event refetches the model
        until(browser, lambda d: "HTTP 401" in d.find_element(By.ID, "error").text, "the wrong key refused")
        settings(browser, api_key=KEY, temperature="0", max_tokens="8")
        browser.find_element(By.ID, "input").click()
        until(browser, lambda d: d.find_element(By.ID, "model").text == "synthetic", "the key accepted")
        prompt = plain_prompt("Key", 8)
        say(browser, prompt)
        assert content_of(finished_answer(browser, 1)) == answer_to([{"role": "user", "content": prompt}], 8)
        browser.refresh()
        assert browser.find_element(By.ID, "api-key").get_attribute("value") == KEY  # kept locally
    finally:
        live.stop()


def test_markdown_renders_a_code_block_and_escapes_script(browser, server):
    open_page(browser, server)
    text = (
        "Here:\n```python\nprint('<b>hi</b>')\n```\n<script>window.pwned = 1</script> **bold** "
        '<img src=x onerror="window.pwned = 2"> [ok](https://example.org) [bad](javascript:alert(1))'
    )
    conversation = [{"role": "user", "content": "show me"}, {"role": "assistant", "content": text}]
    browser.execute_script(
        "localStorage.setItem('pagedgen.chat.history', arguments[0])", json.dumps(conversation)
    )
    browser.refresh()
    until(browser, lambda d: len(answers(d)) == 1, "the stored conversation is shown")
    content = answers(browser)[0].find_element(By.CLASS_NAME, "content")
    code = content.find_element(By.CSS_SELECTOR, "pre > code.language-python")
    assert code.text == "print('<b>hi</b>')"
    assert (
        content.find_elements(By.TAG_NAME, "script") == [] and content.find_elements(By.TAG_NAME, "img") == []
    )
    assert content.find_element(By.TAG_NAME, "strong").text == "bold"
    assert "<script>window.pwned = 1</script>" in content.text
    links = content.find_elements(By.TAG_NAME, "a")
    assert [link.get_attribute("href") for link in links] == ["https://example.org/"]
    assert "[bad](javascript:alert(1))" in content.text
    assert browser.execute_script("return window.pwned === undefined")


RENDERER_CASES = [
    ("plain", "<p>plain</p>"),
    ("a <b> & \"q\" 'x'", "<p>a &lt;b&gt; &amp; &quot;q&quot; &#39;x&#39;</p>"),
    (
        "**b** *i* _u_ `c*d*` 2*3*4 snake_case",
        "<p><strong>b</strong> <em>i</em> <em>u</em> <code>c*d*</code> 2*3*4 snake_case</p>",
    ),
    (
        "```js\nlet a = 1 < 2;\n```\nafter",
        '<pre><code class="language-js">let a = 1 &lt; 2;</code></pre><p>after</p>',
    ),
    ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
    (
        "# Title\n- a\n- b\n1. one\n\nline\nbreak",
        "<h1>Title</h1><ul><li>a</li><li>b</li></ul><ol><li>one</li></ol><p>line<br>break</p>",
    ),
    (
        "[x](https://a.b/?p=1&q=2) [y](mailto:me@a.b) [z](javascript:alert(1)) [w](data:text/html,hi)",
        '<p><a href="https://a.b/?p=1&amp;q=2" target="_blank" rel="noopener noreferrer">x</a> '
        '<a href="mailto:me@a.b" target="_blank" rel="noopener noreferrer">y</a> '
        "[z](javascript:alert(1)) [w](data:text/html,hi)</p>",
    ),
    (
        '[x](https://a.b/"onmouseover="alert(1))',
        '<p><a href="https://a.b/&quot;onmouseover=&quot;alert(1" target="_blank" '
        'rel="noopener noreferrer">x</a>)</p>',
    ),
    ("\u00000\u0000 nul", "<p>0 nul</p>"),
]


def test_the_markdown_renderer_unit_cases(browser, server):
    """The renderer itself, run in the page: escaping first, then the few constructs it knows."""
    open_page(browser, server)
    render = "return window.PagedgenMarkdown.renderMarkdown(arguments[0])"
    assert [browser.execute_script(render, text) for text, _ in RENDERER_CASES] == [
        html for _, html in RENDERER_CASES
    ]


def requests_elsewhere(browser, origin: str) -> list[str]:
    """The URLs the browser sent a request to, since the last call, outside ``origin`` (data: and blob: URLs
    are in-page; a request the page's Content-Security-Policy blocked never left the browser)."""
    sent, blocked = {}, set()
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message["method"] == "Network.requestWillBeSent":
            sent[params["requestId"]] = params["request"]["url"]
        elif message["method"] == "Network.loadingFailed" and params.get("blockedReason") == "csp":
            blocked.add(params["requestId"])
    local = (origin + "/", "data:", "blob:")
    return [url for rid, url in sent.items() if rid not in blocked and not url.startswith(local)]


def test_the_page_and_the_api_docs_load_nothing_from_elsewhere(browser, server):
    """Everything the page, Swagger UI and ReDoc load comes from the server itself (they work offline)."""
    origin = server.url
    open_page(browser, server)
    browser.get_log("performance")
    browser.refresh()
    until(browser, lambda d: d.find_element(By.ID, "model").text == "synthetic", "the page loaded")
    assert requests_elsewhere(browser, origin) == []
    browser.get(origin + "/docs")
    until(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"),
        "Swagger UI listed routes",
    )
    assert "pagedgen" in browser.find_element(By.CSS_SELECTOR, ".swagger-ui .info .title").text
    paths = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/v1/chat/completions", "/v1/completions"} <= paths
    assert requests_elsewhere(browser, origin) == []
    browser.get(origin + "/redoc")
    until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "h1"), "ReDoc drew")
    assert browser.find_element(By.CSS_SELECTOR, "h1").text.startswith("pagedgen")
    assert requests_elsewhere(browser, origin) == []


def test_page_routes_serve_only_their_files_with_a_strict_policy(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(server.url + "/page/chat.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.url + "/", headers={"Host": "evil.example"}).status_code == 421
    for path in ("/page/index.html", "/page/..%2F__init__.py", "/page/nope.js", "/docs/assets/x.js"):
        assert httpx.get(server.url + path).status_code == 404
    assert httpx.get(server.url + "/openapi.json").json()["info"]["title"] == "pagedgen"
