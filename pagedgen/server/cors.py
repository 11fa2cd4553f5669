"""Cross-origin requests (``pagedgen serve --allowed-origins``): which web origins may call the API.

Off by default: no CORS headers, and a browser's preflight (``OPTIONS``) is refused as any other unknown
method is. With a list, Starlette's ``CORSMiddleware`` wraps the whole app, outside the guard: a preflight
carries no API key, so it is answered before the key check, and only for a listed origin (another
origin's preflight is a 400 that grants nothing). The request that follows a preflight passes the guard
as any other (Host allow-list, API key, body limits), and its answer, a refusal included, carries the
``Access-Control-Allow-Origin`` a browser needs to read it. ``*`` allows every origin and is only taken
when written explicitly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

ALLOWED_METHODS = ("GET", "POST", "OPTIONS")
ALLOWED_HEADERS = ("Authorization", "Content-Type")
EXPOSED_HEADERS = ("X-Request-Id",)
PREFLIGHT_MAX_AGE_S = 600
_ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")  # scheme://host[:port]: no path, no trailing slash


def parse_allowed_origins(text: str) -> tuple[str, ...]:
    """``URL[,URL]`` -> the origins; raises ``ValueError`` naming one that is not ``scheme://host[:port]``
    or ``*``."""
    origins = tuple(part.strip() for part in text.split(","))
    for origin in origins:
        check_origin(origin)
    return origins


def check_origin(origin: str) -> None:
    if origin != "*" and _ORIGIN.fullmatch(origin) is None:
        raise ValueError(
            f"allowed origin {origin!r} is not '*' or scheme://host[:port] (http or https, no path), "
            "e.g. http://localhost:3000"
        )


def add_cors(app: FastAPI, origins: Sequence[str]) -> None:
    """Answer cross-origin requests from ``origins``; call it after the guard is added, so the CORS layer
    wraps it (see the module docstring)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=list(ALLOWED_METHODS),
        allow_headers=list(ALLOWED_HEADERS),
        expose_headers=list(EXPOSED_HEADERS),
        max_age=PREFLIGHT_MAX_AGE_S,
    )
