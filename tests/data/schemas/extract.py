"""Regenerate openai-responses.json and anthropic-messages.json from the published OpenAPI documents.

    python tests/data/schemas/extract.py OPENAI_OPENAPI_JSON ANTHROPIC_OPENAPI_JSON

OPENAI_OPENAPI_JSON is `openapi.json` of github.com/openai/openai-openapi, ANTHROPIC_OPENAPI_JSON is
`hosted_spec.json` of github.com/laszukdawid/anthropic-openapi-spec (see README.md for the commits).
From each document it keeps the component schemas its roots reach through `$ref`, as they are, less
what does not validate (descriptions, examples, `x-` vendor extensions); the one `$recursiveRef`
(CompoundFilter's own filters, a 2019-09 keyword that draft 2020-12 ignores) becomes the `$ref` to
CompoundFilter that it means, and Anthropic's `Model` loses its `type: null` (YAML's null, not the
type "null": no type at all, which draft 2020-12 cannot read; its anyOf of strings says what it is).
Every `$ref` stays `#/components/schemas/<Name>`, relative to the file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
DROPPED = {"description", "example", "examples", "$recursiveAnchor"}
# keywords whose value maps names to schemas (the names are data, not keywords)
MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}

OPENAI = {
    "roots": ["ResponseStreamEvent", "Response", "ErrorResponse"],
    "source": {
        "repository": "https://github.com/openai/openai-openapi",
        "commit": "f85dbe223d40e1a31cba812ab2d755c7e98a92a3",
        "path": "openapi.json",
        "info.version": "2.3.0",
        "openapi": "3.1.0",
        "license": "MIT (LICENSE in that repository: Copyright (c) OpenAI)",
    },
}
ANTHROPIC = {
    "roots": ["MessageStreamEvent", "Message", "ErrorResponse"],
    "source": {
        "repository": "https://github.com/laszukdawid/anthropic-openapi-spec",
        "commit": "40cee51a705d03e98f78a5f831c6f0581b3ab71e",
        "path": "hosted_spec.json",
        "openapi": "3.1.0",
        "origin": (
            "Anthropic's OpenAPI document as Anthropic publishes it for its SDKs (the openapi_spec_url "
            "of anthropics/anthropic-sdk-typescript's .stats.yml, storage.googleapis.com/"
            "stainless-sdk-openapi-specs), copied in November 2024; the copy adds an x-api-key header "
            "parameter to its paths only (fix_spec.py there), no component schema is changed"
        ),
        "license": (
            "none stated: neither the copying repository nor Anthropic's hosted document carries a "
            "licence file; kept here as a test fixture, an interface description, with its source"
        ),
    },
}


def _refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$recursiveRef") and isinstance(value, str) and value.startswith("#/"):
                out.add(value.rsplit("/", 1)[-1])
            else:
                _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)


def _closure(schemas: dict[str, Any], roots: list[str]) -> list[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found: set[str] = set()
        _refs(schemas[name], found)
        todo += sorted(found - seen)
    return sorted(seen)


def _strip(node: Any, owner: str) -> Any:
    """A schema less its annotations; owner is the component it belongs to."""
    if isinstance(node, list):
        return [_strip(value, owner) for value in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in DROPPED or key.startswith("x-"):
            continue
        if key == "type" and value is None:
            continue  # Anthropic's Model: `type: null` (YAML's null: no type), its anyOf says what it is
        if key == "$recursiveRef":
            assert value == "#", value
            out["$ref"] = f"#/components/schemas/{owner}"
        elif key in MAPS and isinstance(value, dict):
            out[key] = {name: _strip(sub, owner) for name, sub in value.items()}
        elif key in ("const", "enum", "default", "discriminator"):
            out[key] = value  # data, kept as it is
        else:
            out[key] = _strip(value, owner)
    return out


def extract(document: Path, spec: dict[str, Any], target: Path) -> None:
    schemas = json.loads(document.read_text())["components"]["schemas"]
    names = _closure(schemas, spec["roots"])
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "source": spec["source"],
        "roots": spec["roots"],
        "components": {"schemas": {name: _strip(schemas[name], name) for name in names}},
    }
    target.write_text(json.dumps(out, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{target.name}: {len(names)} schemas, {target.stat().st_size} bytes")


if __name__ == "__main__":
    extract(Path(sys.argv[1]), OPENAI, HERE / "openai-responses.json")
    extract(Path(sys.argv[2]), ANTHROPIC, HERE / "anthropic-messages.json")
