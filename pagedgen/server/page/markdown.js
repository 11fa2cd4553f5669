// A small, safe markdown renderer for the chat page: model text in, HTML out.
//
// Safety comes from the order of work: the text is HTML-escaped first (& < > " '), and only then are the
// few constructs below turned into tags that this file writes itself. No byte of model text reaches the
// page unescaped, so a "<script>" in an answer shows as text. Links keep only http:, https: and mailto:
// targets; any other scheme (javascript:, data:) renders as plain text.
//
// Supported: fenced code blocks (``` with an optional language; an unterminated fence, as while an answer
// streams, runs to the end), inline code, **bold**, *italic* and _italic_, "# " headings, "- " / "* " /
// "1. " lists, [text](url) links, paragraphs (single newlines become <br>).
"use strict";

(function (global) {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function escapeHtml(text) {
    return text.replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
  }

  // Inline markup of one escaped line: code spans are set aside first so nothing inside them is formatted.
  function renderInline(escaped) {
    const spans = [];
    let out = escaped.replace(/`([^`]+)`/g, (_m, code) => {
      spans.push("<code>" + code + "</code>");
      return "\u0000" + (spans.length - 1) + "\u0000";
    });
    out = out.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
      if (!SAFE_URL.test(url)) return whole;
      return '<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + "</a>";
    });
    out = out.replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>");
    out = out.replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?![*\w])/g, "$1<em>$2</em>");
    out = out.replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
    return out.replace(/\u0000(\d+)\u0000/g, (_m, i) => spans[Number(i)]);
  }

  const LIST_ITEM = /^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;

  // Block markup of a run of lines outside code fences.
  function renderBlocks(lines) {
    const html = [];
    let paragraph = [];
    let list = null; // {tag: "ul" | "ol", items: [...]}
    const flushParagraph = () => {
      if (paragraph.length) html.push("<p>" + paragraph.map(renderInline).join("<br>") + "</p>");
      paragraph = [];
    };
    const flushList = () => {
      if (list) {
        const items = list.items.map((item) => "<li>" + renderInline(item) + "</li>").join("");
        html.push("<" + list.tag + ">" + items + "</" + list.tag + ">");
      }
      list = null;
    };
    for (const raw of lines) {
      const line = escapeHtml(raw);
      const heading = HEADING.exec(line);
      const item = LIST_ITEM.exec(line);
      if (line.trim() === "") {
        flushParagraph();
        flushList();
      } else if (heading) {
        flushParagraph();
        flushList();
        const level = heading[1].length;
        html.push("<h" + level + ">" + renderInline(heading[2]) + "</h" + level + ">");
      } else if (item) {
        flushParagraph();
        const tag = item[1] ? "ul" : "ol";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push(item[3]);
      } else {
        flushList();
        paragraph.push(line);
      }
    }
    flushParagraph();
    flushList();
    return html.join("");
  }

  function renderMarkdown(text) {
    const lines = String(text).replace(/\u0000/g, "").split("\n");
    const html = [];
    let prose = [];
    let i = 0;
    while (i < lines.length) {
      const fence = /^\s*```\s*([\w+#.-]*)\s*$/.exec(lines[i]);
      if (!fence) {
        prose.push(lines[i]);
        i += 1;
        continue;
      }
      html.push(renderBlocks(prose));
      prose = [];
      const code = [];
      i += 1;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) {
        code.push(lines[i]);
        i += 1;
      }
      i += 1; // the closing fence (past the end when the fence is still open)
      const lang = fence[1] ? ' class="language-' + escapeHtml(fence[1]) + '"' : "";
      html.push("<pre><code" + lang + ">" + escapeHtml(code.join("\n")) + "</code></pre>");
    }
    html.push(renderBlocks(prose));
    return html.join("");
  }

  global.PagedgenMarkdown = { renderMarkdown, escapeHtml };
})(typeof window !== "undefined" ? window : globalThis);
