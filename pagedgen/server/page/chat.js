// The chat page: a conversation with the server's own /v1/chat/completions, streamed.
//
// The whole message list is sent each turn (the server's prefix cache finds the earlier turns, so a
// follow-up reports cached prompt tokens). Answers stream as server-sent events read from fetch's body;
// Stop aborts the fetch, and the server cancels a request whose client disconnects. The conversation,
// the settings and the API key live in this browser's localStorage only. Model text is shown through
// markdown.js (which escapes it first) or textContent, never as raw HTML.
"use strict";

(function () {
  const HISTORY_KEY = "pagedgen.chat.history";
  const SETTINGS_KEY = "pagedgen.chat.settings";
  const SETTINGS = ["system", "temperature", "max-tokens", "json-schema", "api-key"];
  const $ = (id) => document.getElementById(id);
  const { renderMarkdown } = window.PagedgenMarkdown;

  let history = load(HISTORY_KEY, []); // [{role, content, stats?}]
  let modelId = null;
  let controller = null; // the AbortController of the answer streaming now

  function load(key, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(key));
      return value === null ? fallback : value;
    } catch (_err) {
      return fallback;
    }
  }

  function saveHistory() {
    localStorage.setItem(HISTORY_KEY, JSON.stringify(history));
  }

  function saveSettings() {
    const values = {};
    for (const id of SETTINGS) values[id] = $(id).value;
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
  }

  function restoreSettings() {
    const values = load(SETTINGS_KEY, {});
    for (const id of SETTINGS) if (typeof values[id] === "string") $(id).value = values[id];
  }

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = false;
  }

  function clearError() {
    $("error").hidden = true;
    $("error").textContent = "";
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = $("api-key").value.trim();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  // The error message of a non-2xx response: the OpenAI error body's message when there is one.
  async function errorOf(response) {
    let message = response.statusText;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_err) {
      // not JSON: keep the status text
    }
    return "HTTP " + response.status + ": " + message;
  }

  const UNREACHABLE = "Cannot reach the server: is `pagedgen serve` still running?";
  const CUT_OFF = "The answer was cut off: the connection closed before the server finished it.";

  async function fetchModel() {
    try {
      const response = await fetch("/v1/models", { headers: headers() });
      if (!response.ok) {
        showError(await errorOf(response) + (response.status === 401 ? " (set the API key in Settings)" : ""));
        return null;
      }
      const body = await response.json();
      modelId = body.data[0].id;
      $("model").textContent = modelId;
      clearError();
      return modelId;
    } catch (_err) {
      showError(UNREACHABLE);
      return null;
    }
  }

  // ---------------------------------------------------------------- rendering

  function statsText(stats) {
    if (!stats) return "";
    const parts = [];
    if (stats.completion_tokens !== undefined) parts.push(stats.completion_tokens + " tokens");
    if (stats.tokens_per_s !== undefined) parts.push(stats.tokens_per_s.toFixed(1) + " tokens/s");
    if (stats.cached_tokens !== undefined) {
      parts.push("cached " + stats.cached_tokens + " of " + stats.prompt_tokens + " prompt tokens");
    }
    if (stats.finish_reason) parts.push("finish: " + stats.finish_reason);
    if (stats.stopped) parts.push("stopped");
    return parts.join(" · ");
  }

  function renderMessage(message) {
    const box = document.createElement("div");
    box.className = "msg " + message.role;
    const content = document.createElement("div");
    content.className = "content";
    box.appendChild(content);
    const stats = document.createElement("div");
    stats.className = "stats";
    box.appendChild(stats);
    fill(box, message);
    return box;
  }

  function fill(box, message) {
    const content = box.querySelector(".content");
    if (message.role === "assistant") content.innerHTML = renderMarkdown(message.content);
    else content.textContent = message.content;
    const stats = box.querySelector(".stats");
    stats.textContent = statsText(message.stats);
    stats.hidden = !message.stats;
    stats.classList.toggle("stopped", Boolean(message.stats && message.stats.stopped));
    if (message.stats && message.stats.cached_tokens !== undefined) {
      stats.dataset.cachedTokens = String(message.stats.cached_tokens);
    }
  }

  function renderAll() {
    const list = $("messages");
    list.replaceChildren(...history.map(renderMessage));
    list.scrollTop = list.scrollHeight;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").hidden = !busy;
    $("new").disabled = busy;
  }

  // ---------------------------------------------------------------- a turn

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of history) messages.push({ role: m.role, content: m.content });
    const body = { model: modelId, messages, stream: true, stream_options: { include_usage: true } };
    const temperature = $("temperature").value.trim();
    if (temperature !== "") body.temperature = Number(temperature);
    const maxTokens = $("max-tokens").value.trim();
    if (maxTokens !== "") body.max_tokens = Number(maxTokens);
    const schema = $("json-schema").value.trim();
    if (schema !== "") {
      let parsed;
      try {
        parsed = JSON.parse(schema);
      } catch (err) {
        throw new Error("The JSON schema in Settings is not valid JSON: " + err.message);
      }
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed } };
    }
    return body;
  }

  // Reads SSE events from a fetch body; calls onEvent with each parsed JSON payload until [DONE].
  // Returns true at [DONE], false when the body ended first (the connection was cut).
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return true;
          onEvent(JSON.parse(data));
        }
      }
    }
  }

  async function send() {
    const text = $("input").value;
    if (controller || text.trim() === "") return;
    clearError();
    if (!modelId && !(await fetchModel())) return;
    history.push({ role: "user", content: text });
    let body;
    try {
      body = requestBody();
    } catch (err) {
      history.pop();
      showError(err.message);
      return;
    }
    $("input").value = "";
    const answer = { role: "assistant", content: "" };
    history.push(answer);
    renderAll();
    const box = $("messages").lastElementChild;
    box.classList.add("streaming");
    setBusy(true);
    controller = new AbortController();
    const started = performance.now();
    let firstAt = null;
    let failure = null;
    let stopped = false;
    let redraw = 0;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers(),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorOf(response));
      const complete = await readEvents(response, (chunk) => {
        if (chunk.error) throw new Error("The server ended the answer: " + chunk.error.message);
        const choice = chunk.choices && chunk.choices[0];
        if (choice && choice.delta && choice.delta.content) {
          if (firstAt === null) firstAt = performance.now();
          answer.content += choice.delta.content;
          if (!redraw) redraw = requestAnimationFrame(() => ((redraw = 0), fill(box, answer)));
        }
        if (choice && choice.finish_reason) answer.stats = { finish_reason: choice.finish_reason };
        if (chunk.usage) answer.stats = { ...answer.stats, ...usageStats(chunk.usage, started, firstAt) };
      });
      if (!complete) throw new Error(CUT_OFF);
    } catch (err) {
      if (err.name === "AbortError") stopped = true;
      else failure = err instanceof TypeError ? UNREACHABLE : err.message;
    } finally {
      controller = null;
      if (redraw) cancelAnimationFrame(redraw);
    }
    finishTurn(box, answer, text, stopped, failure);
  }

  function usageStats(usage, started, firstAt) {
    const now = performance.now();
    const tokens = usage.completion_tokens;
    // Decode speed: the tokens after the first over the time after the first (prefill excluded).
    const seconds = (now - (firstAt === null || tokens < 2 ? started : firstAt)) / 1000;
    const counted = firstAt === null || tokens < 2 ? tokens : tokens - 1;
    const details = usage.prompt_tokens_details || {};
    return {
      completion_tokens: tokens,
      prompt_tokens: usage.prompt_tokens,
      cached_tokens: details.cached_tokens || 0,
      tokens_per_s: seconds > 0 ? counted / seconds : 0,
    };
  }

  function finishTurn(box, answer, text, stopped, failure) {
    box.classList.remove("streaming");
    setBusy(false);
    if (stopped) answer.stats = { ...answer.stats, stopped: true };
    if (failure !== null && answer.content === "") {
      // Nothing came back: take the turn off the conversation and give the text back to retry.
      history.splice(history.length - 2, 2);
      $("input").value = text;
      renderAll();
    } else {
      fill(box, answer);
    }
    saveHistory();
    if (failure !== null) showError(failure);
  }

  function stop() {
    if (controller) controller.abort();
  }

  function newConversation() {
    if (controller) return;
    history = [];
    saveHistory();
    clearError();
    renderAll();
    $("input").focus();
  }

  // ---------------------------------------------------------------- wiring

  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", stop);
  $("new").addEventListener("click", newConversation);
  $("settings-toggle").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
  });
  for (const id of SETTINGS) $(id).addEventListener("input", saveSettings);
  $("api-key").addEventListener("change", fetchModel);

  restoreSettings();
  renderAll();
  fetchModel();
})();
