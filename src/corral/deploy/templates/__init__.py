"""Jinja2 templates of the text configs corral renders (NGINX, systemd)."""

from __future__ import annotations

from typing import Any

import jinja2

__all__ = ["render_template"]

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("corral.deploy", "templates"),
    undefined=jinja2.StrictUndefined,  # a missing value is an error, never an empty directive
    keep_trailing_newline=True,
    autoescape=False,  # configuration files, not HTML
)


def render_template(name: str, context: dict[str, Any]) -> str:
    return _ENV.get_template(name).render(**context)
