"""The web console at /console: a static page (vendored uPlot, no build step) that polls the admin API.

The page itself holds nothing secret and is served to anyone; everything it shows comes from admin-only
endpoints (the admin key, a signed-in person's session, or an open gateway's local clients), which it asks
for when refused. The page and its files are sent with a content security policy that allows only the
gateway's own scripts, styles and requests, and that no other page may frame.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from corral.gateway.admin import AdminViews
from corral.gateway.metrics import GatewayMetrics

__all__ = ["ConsoleViews"]

_HERE = Path(__file__).parent
_TYPES = {".html": "text/html", ".js": "application/javascript", ".css": "text/css"}
_FILES = ("index.html", "console.js", "console.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css")
# No other site may frame the console: one click on "revoke" acts, and on a keyless local gateway a framing
# page would be a local admin. The page loads only its own files; its icon is a data: URL (no request).
_SECURITY = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "; ".join(
        (
            "default-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        )
    ),
}


class ConsoleViews:
    def __init__(self, metrics: GatewayMetrics, admin: AdminViews) -> None:
        self._metrics = metrics
        self._admin = admin
        self._files = {name: (_HERE / name).read_bytes() for name in _FILES}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/console", self.page)
        app.router.add_get("/console/{name:.+}", self.asset)
        app.router.add_get("/corral/console/data", self.data)

    async def page(self, request: web.Request) -> web.Response:
        return self._serve("index.html")

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self._files or name == "index.html":
            raise web.HTTPNotFound()
        return self._serve(name)

    def _serve(self, name: str) -> web.Response:
        return web.Response(
            body=self._files[name],
            content_type=_TYPES[Path(name).suffix],
            charset="utf-8",
            headers=_SECURITY,
        )

    async def data(self, request: web.Request) -> web.Response:
        """Cumulative counters and histogram buckets per model (admin only)."""
        await self._admin.check(request)
        at, models = await self._metrics.models_summary()
        return web.json_response({"time": at, "models": models})
