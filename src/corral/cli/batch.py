"""`corral batch`: submit a JSONL file as a batch job, follow it, fetch its results, cancel it."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import aiohttp
import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.cli.app import (
    CaCertOption,
    FlagsCommand,
    FlagsGroup,
    UrlOption,
    app,
    client_tls,
    console,
    fail,
    gateway_url,
    run_async,
)
from corral.config import api_key_from_env

batch_app = typer.Typer(
    help="Batch jobs through the gateway's Batch API: submit a JSONL file, follow it, fetch results.",
    cls=FlagsGroup,
    no_args_is_help=True,
)
app.add_typer(batch_app, name="batch")

KeyOption = Annotated[
    str | None, typer.Option(help="a tenant's API key (default: $CORRAL_API_KEY, then $OPENAI_API_KEY)")
]
BatchArgument = Annotated[str, typer.Argument(help="the batch's id (batch_…)")]
_FINISHED = {"completed", "failed", "expired", "cancelled"}
_PATIENT_S = 120.0  # a followed batch's gateway may be away this long (a restart) before the command ends


class _Gateway:
    """The few Files and Batch API calls the commands make."""

    def __init__(self, url: str | None, api_key: str | None, ca_cert: Path | None) -> None:
        """From the command's options: the address as `gateway_url` resolves it, the key as given or
        from the environment."""
        self._url = gateway_url(url)
        key = api_key_from_env(api_key)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._ssl = client_tls(ca_cert)

    async def call(self, method: str, path: str, patient: float = 0.0, **kwargs: Any) -> Any:
        """The answer's JSON (or bytes); a gateway that does not answer is tried again for `patient`
        seconds (a restart while a batch is followed), then the command ends with exit code 3."""
        waited = 0.0
        while True:
            try:
                return await self._call(method, path, **kwargs)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if waited >= patient:
                    why = f"no corral gateway answers at {self._url}: {_why(exc)}"
                    if patient:  # (following a batch: the batch goes on without us)
                        fail(f"{why} (for {patient:g} s; the batch goes on: `corral batch get`)", 3)
                    fail(why)
                await asyncio.sleep(2.0)
                waited += 2.0

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        async with aiohttp.ClientSession(headers=self._headers) as session:
            async with session.request(method, self._url + path, ssl=self._ssl or True, **kwargs) as response:
                data = await response.read()
                self._refused(response.status, data)
                return data if response.content_type != "application/json" else json.loads(data)

    async def download(self, path: str, sink: BinaryIO) -> int:
        """GET `path`'s body into `sink` as it comes (an output file of gigabytes is never held whole);
        the bytes written."""
        written = 0
        try:
            async with aiohttp.ClientSession(headers=self._headers) as session:
                async with session.get(self._url + path, ssl=self._ssl or True) as response:
                    if response.status >= 400:
                        self._refused(response.status, await response.read())
                    async for chunk in response.content.iter_chunked(1 << 20):
                        sink.write(chunk)
                        written += len(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            fail(f"no corral gateway answers at {self._url}: {_why(exc)}")
        return written

    def _refused(self, status: int, data: bytes) -> None:
        if status == 401:  # the API says which header; the CLI says which flag
            given = "the key given was refused" if self._headers else "no key was given"
            fail(
                f"{self._url} answered 401: a closed gateway needs a tenant's API key ({given}): "
                "pass --api-key or set $CORRAL_API_KEY or $OPENAI_API_KEY"
            )
        if status >= 400:
            fail(f"{self._url} answered {status}: {_message(data)}")


def _why(exc: BaseException) -> str:
    """A failed connection in words, not aiohttp's text."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return "its certificate is not trusted (pass --ca-cert with the CA that signed it)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return (exc.os_error.strerror or str(exc.os_error)).lower()
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return type(exc).__name__


@batch_app.command("submit", cls=FlagsCommand)
def submit(
    file: Annotated[Path, typer.Argument(help="the JSONL file: one {custom_id, method, url, body} per line")],
    window: Annotated[str, typer.Option(help="completion window: 24h, or shorter (30m, 90s)")] = "24h",
    wait: Annotated[bool, typer.Option(help="follow it with a progress bar until it finishes")] = True,
    url: UrlOption = None,
    api_key: KeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Upload FILE and start a batch on it (its endpoint is the lines' `url`). The batch's id goes to stdout
    (`ID=$(corral batch submit FILE --no-wait)`), the rest to stderr; exit 1 when it ends failed, expired
    or cancelled."""
    try:
        content = file.read_bytes()
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}", 2)
    endpoint = _endpoint_of(content)
    gateway = _Gateway(url, api_key, ca_cert)

    async def run() -> None:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename=file.name, content_type="application/jsonl")
        uploaded = await gateway.call("POST", "/v1/files", data=form)
        body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": window}
        batch = await gateway.call("POST", "/v1/batches", json=body)
        print(batch["id"], flush=True)
        requests = sum(1 for line in content.splitlines() if line.strip())
        console.print(f"batch {batch['id']}: {batch['status']}, {requests} requests", markup=False)
        if not wait:
            console.print(f"  follow it: corral batch status {batch['id']}", markup=False, highlight=False)
            return
        if batch["status"] not in _FINISHED:
            batch = await _follow(gateway, batch)
        _summary(batch)
        if batch["status"] != "completed":
            raise typer.Exit(1)

    run_async(run())


@batch_app.command("list", cls=FlagsCommand)
def list_batches(
    limit: Annotated[int, typer.Option(min=1, max=100, help="the most recent this many")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="print the batches as JSON")] = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """The key's tenant's batches, newest first: status and request counts."""
    gateway = _Gateway(url, api_key, ca_cert)

    async def run() -> None:
        found = (await gateway.call("GET", f"/v1/batches?limit={limit}"))["data"]
        if as_json:
            print(json.dumps(found, indent=2))
            return
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for column in ("batch", "status", "completed", "failed", "total", "created"):
            table.add_column(column, overflow="fold")  # an id to copy is folded, never cut
        for batch in found:
            counts = batch.get("request_counts") or {}
            created = datetime.fromtimestamp(batch["created_at"], UTC).strftime("%Y-%m-%d %H:%M")
            table.add_row(
                batch["id"],
                batch["status"],
                *(str(counts.get(k, 0)) for k in ("completed", "failed", "total")),
                created,
            )
        if found:
            Console().print(table)
        else:
            console.print("no batches", markup=False)

    run_async(run())


@batch_app.command("status", cls=FlagsCommand)
def status(
    batch_id: BatchArgument,
    as_json: Annotated[bool, typer.Option("--json", help="print the batch as JSON")] = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """A batch's status and request counts."""
    gateway = _Gateway(url, api_key, ca_cert)

    async def run() -> None:
        batch = await gateway.call("GET", f"/v1/batches/{batch_id}")
        if as_json:
            print(json.dumps(batch, indent=2))
        else:
            _summary(batch)

    run_async(run())


@batch_app.command("results", cls=FlagsCommand)
def results(
    batch_id: BatchArgument,
    errors: Annotated[
        bool, typer.Option("--errors", help="the error file instead of the output file")
    ] = False,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="write here (default: stdout)")
    ] = None,
    url: UrlOption = None,
    api_key: KeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """A finished batch's output (or error) file: one JSON line per request."""
    gateway = _Gateway(url, api_key, ca_cert)

    async def run() -> None:
        batch = await gateway.call("GET", f"/v1/batches/{batch_id}")
        file_id = batch["error_file_id" if errors else "output_file_id"]
        if file_id is None:
            fail(f"batch {batch_id} ({batch['status']}) has no {'error' if errors else 'output'} file")
        content = f"/v1/files/{file_id}/content"
        if output is None:
            await gateway.download(content, sys.stdout.buffer)
            return
        part = output.with_name(output.name + ".part")  # (whole or not at all under its name)
        try:
            with part.open("wb") as sink:
                size = await gateway.download(content, sink)
            part.replace(output)
        finally:
            part.unlink(missing_ok=True)
        console.print(f"wrote {output} ({size} bytes)", markup=False)

    run_async(run())


@batch_app.command("cancel", cls=FlagsCommand)
def cancel(
    batch_id: BatchArgument,
    url: UrlOption = None,
    api_key: KeyOption = None,
    ca_cert: CaCertOption = None,
) -> None:
    """Cancel a batch: lines not started are cancelled, running ones finish and are kept."""
    gateway = _Gateway(url, api_key, ca_cert)

    async def run() -> None:
        _summary(await gateway.call("POST", f"/v1/batches/{batch_id}/cancel"))

    run_async(run())


async def _follow(gateway: _Gateway, batch: dict[str, Any]) -> dict[str, Any]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(batch["id"], total=_total(batch) or None)
        while batch["status"] not in _FINISHED:
            await asyncio.sleep(1.0)
            batch = await gateway.call("GET", f"/v1/batches/{batch['id']}", patient=_PATIENT_S)
            counts = batch.get("request_counts") or {}
            progress.update(
                task,
                total=counts.get("total") or None,  # known once the batch was checked
                completed=counts.get("completed", 0) + counts.get("failed", 0),
                description=f"{batch['id']} {batch['status']}",
            )
    return batch


def _summary(batch: dict[str, Any]) -> None:
    counts = batch.get("request_counts") or {}
    line = (
        f"batch {batch['id']}: {batch['status']}; {counts.get('completed', 0)} completed, "
        f"{counts.get('failed', 0)} failed of {counts.get('total', 0)}"
    )
    console.print(line, markup=False, highlight=False, soft_wrap=True)
    errors = (batch.get("errors") or {}).get("data") or []  # (the gateway lists up to 100)
    for error in errors:
        where = f"line {error['line']}: " if error.get("line") else ""
        console.print(f"  {where}{error['message']}", markup=False, highlight=False, soft_wrap=True)
    say = {"output_file_id": "", "error_file_id": " --errors"}
    for name, flag in say.items():
        if batch.get(name):
            console.print(
                f"  {name}: {batch[name]} (corral batch results {batch['id']}{flag})",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )


def _endpoint_of(content: bytes) -> str:
    for raw in content.splitlines():
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                fail("the file's first line is not a JSON batch request", 2)
            if not isinstance(url, str):
                fail("the file's first line has no 'url' (the endpoint, e.g. /v1/chat/completions)", 2)
            return url
    fail("the file holds no requests", 2)


def _total(batch: dict[str, Any]) -> int:
    return int((batch.get("request_counts") or {}).get("total", 0))


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return data.decode(errors="replace")[:200]
