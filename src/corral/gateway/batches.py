"""OpenAI's Files and Batch API: `/v1/files` and `/v1/batches`, per tenant (a key sees only its tenant's
files and batches; another tenant's id is a 404). The queue and its runner: batch/."""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import IO, Any

import orjson
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from corral.admission import Authenticator, Principal
from corral.batch import BatchStore, NewBatch, TooManyBatches
from corral.batch.files import ENDPOINTS, check_upload
from corral.config import BatchSettings
from corral.gateway.bodies import read_body, within
from corral.protocol import InvalidRequest, NotFound, PayloadTooLarge, RateLimited
from corral.store import FileQuotaExceeded, NewFile
from corral.store.files import FileRecord

__all__ = ["BatchViews"]

_WINDOW = re.compile(r"(\d{1,6})([smh])")  # 999999 s is past the 24 h bound already
_MAX_WINDOW = timedelta(hours=24)
_CHUNK = 1 << 16
_LINE_WRAPPER = 4096  # custom_id, method and url around a line's body
_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")
_EXPIRY_BOUNDS = (3600, 30 * 86400)  # OpenAI's: an hour to 30 days
_UPLOAD_RETRY_S = 5  # Retry-After for an upload past the tenant's uploads in flight
# the ids this server makes (store/files.py, batch/jobs.py): another cannot be one, and is not looked up
_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
_BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
_PURPOSES = frozenset({"batch", "batch_output"})  # the files this server holds
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # not kept in a file's name (PostgreSQL's text holds no NUL)


@dataclass
class _Upload:
    """An upload form as read: its text fields, and the file's name and size (None: no file part)."""

    fields: dict[str, str] = field(default_factory=dict)
    purpose: str | None = None
    filename: str = "upload.jsonl"
    size: int | None = None


@dataclass
class _InFlight:
    """A tenant's uploads in flight at this gateway worker: how many, and the bytes they spooled so far."""

    count: int = 0
    spooled: int = 0


@dataclass
class _Room:
    """What one upload may spool: the tenant's uploads in flight, and the bytes its quota had left when
    this one began."""

    tenant: str
    uploads: _InFlight
    left: int
    quota: int


class BatchViews:
    """The HTTP face of files and batches."""

    def __init__(
        self,
        store: BatchStore,
        auth: Authenticator,
        settings: BatchSettings,
        body_timeout: float = 30.0,
        max_body_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._store = store
        self._auth = auth
        self._settings = settings
        self._idle = body_timeout  # an upload's silence between parts or chunks
        self._body = (body_timeout, max_body_bytes)
        self._max_line = max_body_bytes + _LINE_WRAPPER  # a batch line: a request body and its wrapper
        self._uploads: dict[str, _InFlight] = {}  # per tenant with uploads in flight here

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.files)
        app.router.add_get("/v1/files/{id}", self.file)
        app.router.add_get("/v1/files/{id}/content", self.content)
        app.router.add_delete("/v1/files/{id}", self.delete)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.batches)
        app.router.add_get("/v1/batches/{id}", self.batch)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    async def _principal(self, request: web.Request) -> Principal:
        return await self._auth.authenticate(request.headers.get("Authorization"))

    async def upload(self, request: web.Request) -> web.Response:
        """multipart/form-data with `purpose` (batch), `file` (JSONL) and optionally OpenAI's
        `expires_after[anchor]` / `expires_after[seconds]`. The file is spooled to a temporary file on disk
        (one chunk in memory), checked line by line, and stored a part at a time."""
        principal = await self._principal(request)
        if not request.content_type.startswith("multipart/"):
            raise InvalidRequest("Upload the file as multipart/form-data with fields 'purpose' and 'file'.")
        quota = self._quota(principal)
        with (
            self._in_flight(principal.tenant) as uploads,
            tempfile.TemporaryFile(prefix="corral-upload-") as spool,
        ):
            held = await self._room(principal, quota, 1)  # (before the body is read: a full tenant: nothing)
            room = _Room(principal.tenant, uploads, quota[1] - held, quota[1])
            try:
                form = await self._form(request, spool, room)
            except (ValueError, UnicodeDecodeError, BadHttpMessage) as exc:  # a broken boundary, part header
                raise InvalidRequest(f"The multipart body cannot be read: {exc}.") from exc
            if form.purpose != "batch":
                raise InvalidRequest(
                    "'purpose' must be \"batch\" (the only purpose this server takes).", param="purpose"
                )
            if form.size is None:
                raise InvalidRequest("The upload has no 'file' part.", param="file")
            now = datetime.now(UTC)
            expires_at = now + min(_expiry(form.fields), self._settings.file_expiry)
            spool.seek(0)
            await asyncio.to_thread(check_upload, spool, self._settings.max_lines, self._max_line)
            spool.seek(0)
            new = NewFile(principal.tenant, form.purpose, form.filename, spool, form.size, expires_at, now)
            try:
                record = await asyncio.to_thread(self._store.files.add_file, new, quota)
            except FileQuotaExceeded as exc:
                raise RateLimited(str(exc), code="files_quota_exceeded") from exc
        return web.json_response(record.to_api())

    def _quota(self, principal: Principal) -> tuple[int, int]:
        """(files, bytes) `principal`'s tenant may hold: the key's own caps where it has them, else the
        spec's for every tenant."""
        return (
            principal.max_files or self._settings.tenant_max_files,
            principal.max_file_bytes or self._settings.tenant_max_bytes,
        )

    async def _room(self, principal: Principal, quota: tuple[int, int], adding: int) -> int:
        """429 files_quota_exceeded where the tenant's files' quota has no room for `adding` more (or is
        passed: 0); else the bytes the tenant holds."""
        try:
            return await asyncio.to_thread(self._store.files.check_room, principal.tenant, quota, adding)
        except FileQuotaExceeded as exc:
            raise RateLimited(str(exc), code="files_quota_exceeded") from exc

    @contextlib.contextmanager
    def _in_flight(self, tenant: str) -> Iterator[_InFlight]:
        """One of `tenant`'s uploads in flight: 429 with Retry-After past `batch.tenant_max_uploads` (before,
        a tenant with a 1 MB quota spooled ten 20 MB uploads at once, each refused only once read)."""
        uploads = self._uploads.setdefault(tenant, _InFlight())
        if uploads.count >= self._settings.tenant_max_uploads:
            raise RateLimited(
                f"Tenant '{tenant}' is sending {uploads.count} uploads at once, its limit; send the next "
                "once one has finished.",
                code="too_many_uploads",
                retry_after=_UPLOAD_RETRY_S,
            )
        uploads.count += 1
        try:
            yield uploads
        finally:
            uploads.count -= 1
            if not uploads.count:
                del self._uploads[tenant]

    async def _form(self, request: web.Request, spool: IO[bytes], room: _Room) -> _Upload:
        """The form's fields; the `file` part is written to `spool`."""
        form = _Upload()
        reader = await request.multipart()
        while (part := await within(reader.next(), self._idle)) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "file":
                if spool.tell():  # (a second file part: its bytes would join the first's, unmeasured)
                    raise InvalidRequest("The upload holds more than one file part; send one.", param="file")
                form.filename = _CONTROL.sub("_", part.filename or form.filename)[:256]
                form.size = await self._spool(part, spool, room)
            elif part.name in _FIELDS:
                form.fields[part.name] = (await within(_part_text(part), self._idle)).strip()
        form.purpose = form.fields.get("purpose")
        return form

    async def _spool(self, part: BodyPartReader, spool: IO[bytes], room: _Room) -> int:
        """The file part written to `spool`, refused as it arrives once it passes `batch.max_file_bytes`, or
        once it and the tenant's other uploads in flight pass the room its quota had left (the error the
        quota gives once the file is in)."""
        size = 0
        try:
            while chunk := await within(part.read_chunk(_CHUNK), self._idle):
                size += len(chunk)
                room.uploads.spooled += len(chunk)
                if size > self._settings.max_file_bytes:
                    raise PayloadTooLarge(
                        f"The file is larger than the limit of {self._settings.max_file_bytes} bytes."
                    )
                if room.uploads.spooled > room.left:
                    raise RateLimited(
                        f"Tenant '{room.tenant}' would hold more than its limit of {room.quota:,} bytes of "
                        "files with this upload (and its others in flight); delete some first.",
                        code="files_quota_exceeded",
                    )
                spool.write(chunk)  # to the page cache: microseconds a chunk
        finally:
            room.uploads.spooled -= size  # (once stored, the file counts in what the tenant holds)
        return size

    async def files(self, request: web.Request) -> web.Response:
        principal = await self._principal(request)
        limit, after = _paging(request, default=10_000)
        purpose = request.query.get("purpose")
        if purpose and purpose not in _PURPOSES:  # (another of OpenAI's purposes: none held here)
            return _listing([], limit)
        found = await asyncio.to_thread(self._store.files.files, principal.tenant, purpose, limit + 1, after)
        return _listing([f.to_api() for f in found], limit)

    async def file(self, request: web.Request) -> web.Response:
        principal = await self._principal(request)
        found = await self._file(principal, request.match_info["id"])
        return web.json_response(found.to_api())

    async def _file(self, principal: Principal, file_id: str) -> FileRecord:
        """The tenant's file, or 404 (an id of a shape this server never makes: without a look-up)."""
        found = None
        if _FILE_ID.fullmatch(file_id):
            found = await asyncio.to_thread(self._store.files.file, principal.tenant, file_id)
        if found is None:
            raise _no_file(file_id)
        return found

    async def content(self, request: web.Request) -> web.StreamResponse:
        """The file's content, sent a stored part at a time."""
        principal = await self._principal(request)
        file_id = request.match_info["id"]
        found = await self._file(principal, file_id)
        answer = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        answer.content_length = found.bytes
        await answer.prepare(request)
        parts = self._store.files.file_parts(file_id)
        while (data := await asyncio.to_thread(next, parts, None)) is not None:
            await answer.write(data)
        await answer.write_eof()
        return answer

    async def delete(self, request: web.Request) -> web.Response:
        principal = await self._principal(request)
        file_id = request.match_info["id"]
        await self._file(principal, file_id)  # (an id this server never makes: 404 without a look-up)
        if not await asyncio.to_thread(self._store.files.delete_file, principal.tenant, file_id):
            raise _no_file(file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def create(self, request: web.Request) -> web.Response:
        principal = await self._principal(request)
        body = _json_object(await read_body(request, *self._body))
        endpoint, window, meta = _batch_fields(body)
        window_text = str(body.get("completion_window", "24h"))
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise InvalidRequest("'input_file_id' must name an uploaded file.", param="input_file_id")
        found = await self._file(principal, file_id)
        if found.purpose != "batch":
            raise InvalidRequest(
                f"File {file_id} is not a batch input (purpose {found.purpose}).", param="input_file_id"
            )
        await self._room(principal, self._quota(principal), 0)  # (its results are files: none at the quota)
        key_id = principal.key_id[:32] if principal.key_id else None  # (a signed-in person's oidc:<tenant>)
        new = NewBatch(principal.tenant, key_id, endpoint, file_id, window, window_text, meta)
        try:  # (validated by the runner)
            record = await asyncio.to_thread(self._store.create_batch, new, self._settings.tenant_max_active)
        except TooManyBatches as exc:
            raise RateLimited(str(exc), code="batches_quota_exceeded") from exc
        return web.json_response(record.to_api())

    async def batches(self, request: web.Request) -> web.Response:
        principal = await self._principal(request)
        limit, after = _paging(request, default=20)
        if after is not None and not _BATCH_ID.fullmatch(after):  # (no batch has it: none after it)
            return _listing([], limit)
        found = await asyncio.to_thread(self._store.batches, principal.tenant, limit + 1, after)
        return _listing([b.to_api() for b in found], limit)

    async def batch(self, request: web.Request) -> web.Response:
        principal = await self._principal(request)
        batch_id = request.match_info["id"]
        found = None
        if _BATCH_ID.fullmatch(batch_id):  # (an id this server never makes: 404 without a look-up)
            found = await asyncio.to_thread(self._store.batch, principal.tenant, batch_id)
        if found is None:
            raise _no_batch(batch_id)
        return web.json_response(found.to_api())

    async def cancel(self, request: web.Request) -> web.Response:
        principal = await self._principal(request)
        batch_id = request.match_info["id"]
        found = None
        if _BATCH_ID.fullmatch(batch_id):
            found = await asyncio.to_thread(self._store.cancel, principal.tenant, batch_id)
        if found is None:
            raise _no_batch(batch_id)
        return web.json_response(found.to_api())


async def _part_text(part: BodyPartReader) -> str:
    """A form field's text in the charset and transfer encoding it declares; 400 for ones unknown."""
    try:
        return await part.text()
    except LookupError as exc:  # a charset Python does not know
        raise InvalidRequest(f"Part '{part.name}' has an unknown charset: {exc}.", param=part.name) from exc
    except RuntimeError as exc:  # aiohttp: "unknown content transfer encoding"
        raise InvalidRequest(f"Part '{part.name}' cannot be decoded: {exc}.", param=part.name) from exc


def _expiry(fields: dict[str, str]) -> timedelta:
    """OpenAI's `expires_after` (anchor `created_at`, an hour to 30 days); unset: the longest."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return timedelta(seconds=_EXPIRY_BOUNDS[1])
    low, high = _EXPIRY_BOUNDS
    digits = seconds if seconds is not None and re.fullmatch(r"[0-9]{1,8}", seconds) else "0"
    if anchor != "created_at" or not low <= int(digits) <= high:
        raise InvalidRequest(
            f"'expires_after' takes anchor \"created_at\" and seconds from {low} to {high}.",
            param="expires_after",
        )
    return timedelta(seconds=int(digits))


def _batch_fields(body: dict[str, Any]) -> tuple[str, timedelta, dict[str, str] | None]:
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise InvalidRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    window = _window(body.get("completion_window", "24h"))
    meta = body.get("metadata")
    if meta is not None and (
        not isinstance(meta, dict)
        or len(meta) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in meta.items()
        )
    ):
        raise InvalidRequest(
            "'metadata' holds at most 16 string pairs (keys ≤ 64, values ≤ 512 chars).", param="metadata"
        )
    return str(endpoint), window, meta


def _window(value: Any) -> timedelta:
    """OpenAI takes "24h"; corral also takes a shorter window ("90s", "30m", "2h")."""
    found = _WINDOW.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        raise InvalidRequest(
            '\'completion_window\' must be "24h" (or a shorter "30m", "90s").', param="completion_window"
        )
    amount, unit = int(found[1]), found[2]
    window = timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours"}[unit]: amount})
    if not timedelta(0) < window <= _MAX_WINDOW:
        raise InvalidRequest("'completion_window' must be at most 24h.", param="completion_window")
    return window


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}.") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    return body


def _paging(request: web.Request, default: int) -> tuple[int, str | None]:
    try:
        limit = int(request.query.get("limit", default))
    except ValueError as exc:
        raise InvalidRequest("'limit' must be a whole number.", param="limit") from exc
    if not 1 <= limit <= 10_000:
        raise InvalidRequest("'limit' must be between 1 and 10000.", param="limit")
    return limit, request.query.get("after")


def _listing(items: list[dict[str, Any]], limit: int) -> web.Response:
    page = items[:limit]
    return web.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def _no_file(file_id: str) -> NotFound:
    return NotFound(f"No such file: {_shown(file_id)}.", param="file_id")


def _no_batch(batch_id: str) -> NotFound:
    return NotFound(f"No such batch: {_shown(batch_id)}.", param="batch_id")


def _shown(value: str) -> str:
    """A client's id as an error repeats it: its first 64 characters, control characters escaped."""
    cut = value[:64] + ("…" if len(value) > 64 else "")
    return _CONTROL.sub(lambda found: f"\\x{ord(found[0]):02x}", cut)
