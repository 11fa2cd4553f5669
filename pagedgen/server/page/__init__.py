"""The chat page at ``/``: plain HTML, CSS and JavaScript shipped in this package, served as they are.

The page talks to the server's own ``/v1/chat/completions`` (streamed), so it holds no secret and needs no
API key to load: the guard keys only ``/v1/*`` and the API docs, and the page's API calls carry the key the
user types (kept in the browser's local storage). Nothing is fetched from elsewhere: no CDN, no fonts, no
build step. The files are read once when the app is built; ``/page/NAME`` serves only the names listed here
(no path is ever built from the request). Every answer carries a Content-Security-Policy that allows only
this origin's scripts, styles and connections: even a renderer bug could not run an answer's text as code.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from pagedgen.server.guard import error_json

PAGE_URL = "/page/"
_FILES = {"chat.js": "text/javascript", "markdown.js": "text/javascript", "chat.css": "text/css"}
_INDEX = "index.html"
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True, slots=True)
class PageFile:
    body: bytes
    media_type: str

    def response(self) -> Response:
        return Response(self.body, media_type=self.media_type, headers=_HEADERS)


def page_files() -> dict[str, PageFile]:
    """The page's files by name, read from the installed package."""
    folder = resources.files(__name__)
    files = {name: PageFile(folder.joinpath(name).read_bytes(), kind) for name, kind in _FILES.items()}
    files[_INDEX] = PageFile(folder.joinpath(_INDEX).read_bytes(), "text/html; charset=utf-8")
    return files


def add_chat_page(app: FastAPI) -> None:
    """``GET /`` (the page) and ``GET /page/NAME`` (its script and style files)."""
    files = page_files()

    @app.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return files[_INDEX].response()

    @app.get(PAGE_URL + "{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        if name not in _FILES:
            return error_json(404, f"the chat page has no file {name!r}")
        return files[name].response()
