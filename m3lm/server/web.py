"""The chat page at GET /: three static files shipped in the package, served with a strict CSP.

The page is plain HTML, CSS and JavaScript that talks to the server's own API; it needs nothing
from any other origin. Its files are public (a browser fetches them before it can ask for a key);
the API calls it makes still need the key. The routes serve a fixed set of files read once at
start, so no request path ever reaches the file system.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# No inline script or style and no other origin: a model's text that slipped into the DOM as
# markup still could not run or load anything.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a newer m3lm's page is picked up at once
}
# URL path -> (file under m3lm/server/web/, media type)
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/web/app.css": ("app.css", "text/css; charset=utf-8"),
}
PATHS = frozenset(FILES)


def add_web_ui(app: FastAPI) -> None:
    """Serve the page's files on `app` (outside the OpenAPI schema: they are not the API)."""
    folder = resources.files("m3lm.server").joinpath("web")
    for path, (name, media_type) in FILES.items():
        app.add_api_route(
            path, _file_route(folder.joinpath(name).read_bytes(), media_type), include_in_schema=False
        )


def _file_route(body: bytes, media_type: str):
    async def page() -> Response:  # no parameters: a query string changes nothing
        return Response(body, media_type=media_type, headers=HEADERS)

    return page
