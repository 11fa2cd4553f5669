"""FastAPI's interactive API docs (``/docs``: Swagger UI, ``/redoc``: ReDoc) with their assets served locally.

FastAPI's own docs pages load Swagger UI and ReDoc from a CDN, so they are blank on a machine without
internet. The ``fastapi-offline`` package (MIT; the Swagger UI files it carries are Apache-2.0, ReDoc's MIT)
ships those assets; we serve its files from ``/docs/assets/NAME`` (a fixed list of names, read once) and
build the two pages with FastAPI's own HTML helpers pointing there. ReDoc's page would still fetch Redocly's
logo from their CDN: the pages' Content-Security-Policy allows this origin only (and the inline scripts
FastAPI's pages start with), so the browser makes no request elsewhere. The pages need the API key when one is
set (the guard keys them); the assets hold nothing of this server and need none.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response

from pagedgen.server.guard import error_json

ASSETS_URL = "/docs/assets/"
_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
_OAUTH2_REDIRECT = "/docs/oauth2-redirect"
_POLICY = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; worker-src 'self' blob:; base-uri 'none'; frame-ancestors 'none'"
    )
}


def _local(page: HTMLResponse) -> HTMLResponse:
    page.headers.update(_POLICY)
    return page


def add_offline_docs(app: FastAPI) -> None:
    """``/docs``, ``/docs/oauth2-redirect`` and ``/redoc`` on ``app`` (built with ``docs_url=None`` and
    ``redoc_url=None``; its ``openapi_url`` is what the pages load), and their assets."""
    folder = resources.files("fastapi_offline").joinpath("static")
    assets = {name: folder.joinpath(name).read_bytes() for name in _ASSETS}
    openapi_url = app.openapi_url
    if openapi_url is None:
        raise ValueError("the API docs pages need the app's openapi_url")
    favicon = ASSETS_URL + "favicon.png"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=_OAUTH2_REDIRECT,
            swagger_js_url=ASSETS_URL + "swagger-ui-bundle.js",
            swagger_css_url=ASSETS_URL + "swagger-ui.css",
            swagger_favicon_url=favicon,
            swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from swagger.io
        )
        return _local(page)

    @app.get(_OAUTH2_REDIRECT, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=ASSETS_URL + "redoc.standalone.js",
            redoc_favicon_url=favicon,
            with_google_fonts=False,
        )
        return _local(page)

    @app.get(ASSETS_URL + "{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in _ASSETS:
            return error_json(404, f"the API docs have no asset {name!r}")
        return Response(assets[name], media_type=_ASSETS[name], headers={"Cache-Control": "max-age=86400"})
