"""`corral reference`: the generated reference pages of the documentation site (docs/reference/).

Each page is rendered from the code it describes, so it cannot drift: the CLI from the typer app, the spec
from config's models (`corral.spec_reference`), the HTTP API from the OpenAPI document the gateway serves,
the metrics from the gateway's registry and its scrape-time series, the alerts from the rules and their
runbook. The output is deterministic (no dates, no machine paths); tests/docs fails when a checked-in page
differs from it.
"""

from __future__ import annotations

import html
import inspect
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from corral.cli.app import FlagsCommand, app, console

if TYPE_CHECKING:
    from corral.gateway.state_metrics import Family

__all__ = ["REGENERATE", "reference_pages", "write_reference_pages"]

REGENERATE = "corral reference -o docs/reference"
_GENERATED = "<!-- Generated from {source} by `" + REGENERATE + "`; a test fails when this file is stale. -->"


@app.command("reference", cls=FlagsCommand)
def reference_command(
    output: Annotated[Path, typer.Option("--output", "-o", help="folder to write the pages into")],
) -> None:
    """Write the reference pages (CLI, spec, HTTP API, metrics, alerts) as Markdown, and openapi.json."""
    for name in write_reference_pages(output):
        console.print(f"wrote {output / name}", markup=False, highlight=False)


def write_reference_pages(folder: Path) -> list[str]:
    """Write every page into `folder`; the names written."""
    folder.mkdir(parents=True, exist_ok=True)
    pages = reference_pages()
    for name, text in pages.items():
        (folder / name).write_text(text, encoding="utf-8")
    return list(pages)


def reference_pages() -> dict[str, str]:
    """Every generated file of docs/reference/, by name."""
    from corral.spec_reference import spec_reference

    document = _openapi()
    return {
        "cli.md": cli_reference(),
        "spec.md": spec_reference(),
        "http-api.md": http_reference(document),
        "openapi.json": json.dumps(document, indent=2, ensure_ascii=False) + "\n",
        "metrics.md": metrics_reference(),
        "alerts.md": alerts_reference(),
    }


# --- the command line -------------------------------------------------------------------------------


def cli_reference() -> str:
    """Every visible command and option of `corral`, as `corral COMMAND --help` shows them."""
    root = typer.main.get_command(app)
    context = root.context_class(root, info_name="corral")
    parts = [
        "# Command-line reference\n",
        _GENERATED.format(source="the typer app (src/corral/cli/)") + "\n",
        "Every `corral` command with its arguments and options, as `corral COMMAND --help` prints them. "
        "Options that talk to a gateway find it with `--url`, else the spec's `gateway` section (`-f`), "
        "else `$CORRAL_URL`, else `$OPENAI_BASE_URL` without its `/v1`, else `http://127.0.0.1:8000`.\n",
        _command_section(root, context, 1),
    ]
    return "\n".join(part for part in parts if part)


def _commands(group: Any, context: Any) -> list[tuple[Any, Any]]:
    """A group's visible subcommands in `corral --help` order, each with its own context."""
    found = []
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if command is not None and not command.hidden:
            found.append((command, command.context_class(command, info_name=name, parent=context)))
    return found


def _command_section(command: Any, context: Any, level: int) -> str:
    path = context.command_path
    subcommands = _commands(command, context) if hasattr(command, "list_commands") else []
    heading = "#" * min(level, 4)
    out = [f"{heading} `{path}`\n"] if level > 1 else []
    help_text = inspect.cleandoc(command.help or "")
    if help_text:
        out.append("\n\n".join(" ".join(p.split()) for p in help_text.split("\n\n")) + "\n")
    usage = " ".join(command.collect_usage_pieces(context))
    out.append(f"```text\n{path} {usage}\n```\n")
    records = [
        param.get_help_record(context) for param in command.get_params(context) if param.name != "help"
    ]
    rows = [(_code(names.strip()), _cell(meaning)) for names, meaning in filter(None, records)]
    if rows:
        out.append(_table(("argument or option", "meaning"), rows))
    if subcommands:
        listing = [
            (f"[`{sub.command_path}`](#{_anchor(sub.command_path)})", _cell(cmd.get_short_help_str(200)))
            for cmd, sub in subcommands
        ]
        out.append(_table(("command", "what it does"), listing))
    out += [_command_section(cmd, sub, level + 1) for cmd, sub in subcommands]
    return "\n".join(out)


def _anchor(heading: str) -> str:
    """The id MkDocs' table of contents gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _code(text: str) -> str:
    """A code span for a table cell. One holding a pipe is written as HTML: MkDocs' Markdown would show
    the backslash of an escaped pipe inside a code span, GitHub's needs the escape."""
    if "|" not in text:
        return f"`{text}`"
    return "<code>" + html.escape(text, quote=False).replace("|", "&#124;") + "</code>"


def _cell(text: str) -> str:
    """Prose in a table cell: one line, pipes escaped, angle brackets shown rather than read as HTML."""
    text = " ".join(text.split()).replace("|", "\\|")
    pieces = text.split("`")
    pieces[::2] = [p.replace("<", "&lt;") for p in pieces[::2]]  # outside code spans only
    return "`".join(pieces)


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    """A Markdown table; cells are written as given."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- the HTTP API -----------------------------------------------------------------------------------


def _openapi() -> dict[str, Any]:
    from corral.protocol.openapi import openapi_document
    from corral.store import NewKey

    return openapi_document(None, NewKey.model_json_schema())


def http_reference(document: dict[str, Any]) -> str:
    """Every route of the gateway with its parameters, body and answers, then every schema."""
    parts = [
        "# HTTP API reference\n",
        _GENERATED.format(source="src/corral/protocol/openapi.py") + "\n",
        "The gateway serves this OpenAPI 3.1 document at `/openapi.json`; the same document is "
        "[openapi.json](openapi.json) here (load it into any OpenAPI viewer or client generator). "
        "On a closed gateway every request carries a key, `Authorization: Bearer KEY` (or `x-api-key: KEY` "
        "on `/v1/messages`, as Anthropic's clients send it); `/admin/*` takes the admin key or a key whose "
        "role allows the route ([Security](../operations/security.md)). Every refusal is OpenAI-shaped JSON "
        "([`ErrorResponse`](#errorresponse)); `/v1/messages` answers in Anthropic's shape "
        "([`AnthropicError`](#anthropicerror)).\n",
        "## Routes\n",
        _table(
            ("method", "path", "what it does"),
            (
                (method.upper(), f"[`{path}`](#{_anchor(f'{method} {path}')})", _cell(op["summary"]))
                for path, method, op in _operations(document)
            ),
        ),
    ]
    parts += [_operation(path, method, op) for path, method, op in _operations(document)]
    parts.append("## Schemas\n")
    parts += [_schema(name, schema) for name, schema in document["components"]["schemas"].items()]
    return "\n".join(parts)


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in document["paths"].items() for method, op in ops.items()]


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    out = [f"### `{method.upper()} {path}`\n", _cell(op["summary"]) + ".\n"]
    params = op.get("parameters", [])
    if params:
        rows = [
            (
                f"`{p['name']}`" + (" (required)" if p.get("required") else ""),
                p["in"],
                _type(p.get("schema", {})),
                _cell(p.get("description", "")),
            )
            for p in params
        ]
        out.append(_table(("parameter", "in", "type", "meaning"), rows))
    body = op.get("requestBody")
    if body:
        out.append(
            f"Body ({'required' if body.get('required') else 'optional'}): {_bodies(body['content'])}.\n"
        )
        out += [
            _fields(m["schema"]) for m in body["content"].values() if m.get("schema", {}).get("properties")
        ]
    answers = [
        (status, _cell(answer.get("description", "")), _bodies(answer.get("content", {})))
        for status, answer in sorted(op["responses"].items())
    ]
    out.append(_table(("status", "meaning", "body"), answers))
    return "\n".join(out)


def _bodies(content: dict[str, Any]) -> str:
    """Each media type of a body with its schema."""
    return "; ".join(f"`{kind}` {_type(media.get('schema', {}))}" for kind, media in content.items())


def _schema(name: str, schema: dict[str, Any]) -> str:
    out = [f"### `{name}`\n"]
    if schema.get("description"):
        out.append(_cell(schema["description"]) + "\n")
    out.append(_fields(schema) if schema.get("properties") else f"{_type(schema)}.\n")
    return "\n".join(out)


def _fields(schema: dict[str, Any]) -> str:
    """An object schema's fields as a table: type, default (or required), meaning where described."""
    properties: dict[str, Any] = schema["properties"]
    required = set(schema.get("required", []))
    described = any(p.get("description") for p in properties.values())
    rows = []
    for field, prop in properties.items():
        default = _code(json.dumps(prop["default"])) if "default" in prop else "unset"
        row = (f"`{field}`", _type(prop), "**required**" if field in required else default)
        rows.append((*row, _cell(prop.get("description", ""))) if described else row)
    header = ("field", "type", "default", "meaning") if described else ("field", "type", "default")
    extra = "\nOther fields are allowed (and passed on).\n" if schema.get("additionalProperties") else ""
    return _table(header, rows) + extra


def _type(schema: dict[str, Any]) -> str:
    """A JSON schema as a short phrase; references link to their schema."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[`{name}`](#{name.lower()})"
    if "const" in schema:
        return _code(json.dumps(schema["const"]))
    if "enum" in schema:
        return " \\| ".join(_code(json.dumps(v)) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(_type(s) for s in schema[key]))
    kind = schema.get("type")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if isinstance(kind, list):
        return " or ".join(kind)
    return str(kind) if kind else "any"


# --- metrics ----------------------------------------------------------------------------------------


def metric_families() -> tuple[list[Family], list[Family]]:
    """Every family the gateway's /metrics serves, by its exposed name: those counted as requests end, and
    those read at each scrape."""
    from prometheus_client.metrics import MetricWrapperBase

    from corral.gateway.metrics import GatewayMetrics
    from corral.gateway.state_metrics import Family, StateSeries
    from corral.routing import ReplicaSet, Router

    router = Router(ReplicaSet())
    counted = []
    metrics = GatewayMetrics(router, dict)
    for collector in [*vars(metrics).values(), *vars(metrics.usage).values()]:
        # (a labelled child, such as one `use` of corral_store_errors, is its parent's series)
        if isinstance(collector, MetricWrapperBase) and not collector._labelvalues:
            labels = tuple(collector._labelnames)  # prometheus_client keeps a metric's label names only there
            for family in collector.describe():
                name = f"{family.name}_total" if family.type == "counter" else family.name
                counted.append(Family(name, family.type, family.documentation, labels))
    return counted, StateSeries(router, dict, list).families()


def metrics_reference() -> str:
    """Every metric with its type, labels and meaning."""
    parts = [
        "# Metrics reference\n",
        _GENERATED.format(source="src/corral/gateway/metrics.py and state_metrics.py") + "\n",
        "The gateway serves these at `/metrics` in Prometheus' text format (a closed gateway asks for "
        "`gateway.metrics_token` or the admin key). A histogram is exposed as `NAME_bucket` (label "
        "`le`), `NAME_sum` and `NAME_count`; each counter and histogram series also has a `NAME_created` "
        "timestamp. With several gateway workers (`gateway.workers`), any worker's `/metrics` sums every "
        "worker's figures; the replicas' readiness, states, restarts and engine load are the supervisor's, "
        "written by the worker that answers (a replica that left leaves them). The engines' own metrics "
        "(vLLM's `vllm:*`, llama.cpp's `llamacpp:*`) are "
        "scraped from the engines directly (`corral observe render` writes that scrape job); their load "
        "is also here, in one shape for every engine, as `corral_engine_*`.\n",
    ]
    for title, families in zip(
        ("Counted as requests end", "Read at each scrape"), metric_families(), strict=True
    ):
        rows = [
            (f"`{f.name}`", f.kind, ", ".join(f"`{label}`" for label in f.labels) or "-", _cell(f.doc))
            for f in families
        ]
        parts += [f"## {title}\n", _table(("metric", "type", "labels", "meaning"), rows)]
    return "\n".join(parts)


# --- alerts -----------------------------------------------------------------------------------------

# The spec the alerts are shown for: the SLO alerts exist only for a model with an SLO.
_ALERTS_SPEC = """\
models:
  - name: MODEL
    arch: llama-3.1-8b
    slo: {ttft_p95: 0.5, itl_p95: 0.05}
    deployments: [{engine: sim, gpu: l4}]
"""


def alerts_reference() -> str:
    """Every alert rule: the runbook's section on it, then when it fires."""
    from corral.config import parse_spec
    from corral.observe.rules import RUNBOOK, alert_rules

    spec = parse_spec(_ALERTS_SPEC)
    rules = {rule.name.lower(): rule for rule in alert_rules(spec)}
    intro, *sections = RUNBOOK.read_text(encoding="utf-8").split("\n## ")
    title, _, lead = intro.partition("\n")
    parts = [
        f"{title}\n",
        _GENERATED.format(source="src/corral/observe/rules.py and runbook.md") + "\n",
        lead.strip() + "\n",
        _table(
            ("alert", "severity", "for"),
            (
                (
                    f"[{rule.name}](#{anchor})",
                    rule.severity,
                    "at once" if rule.duration == "0m" else rule.duration,
                )
                for anchor, rule in rules.items()
            ),
        ),
        f"The expressions below are those `corral observe render` writes for a spec whose model `MODEL` "
        f"has `slo: {{ttft_p95: 0.5, itl_p95: 0.05}}` (the SLO alerts exist for each model with an SLO) "
        f"and the default `queue.timeout` of {spec.queue.timeout:g} s.\n",
    ]
    for section in sections:
        anchor, _, body = section.partition("\n")
        rule = rules[anchor.strip()]
        when = "as soon as this holds" if rule.duration == "0m" else f"when this holds for {rule.duration}"
        parts.append(f"## {anchor.strip()}\n{body.strip()}\n\nFires {when}:\n\n```promql\n{rule.expr}\n```\n")
    return "\n".join(parts)
