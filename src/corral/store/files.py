"""Uploaded and produced files (the Files API): content kept in the SQL store in parts, per tenant.

A file's content is stored as parts of at most `PART_BYTES` (rows of `corral_file_parts`), written and read
one part at a time, so neither an upload nor a download holds a whole file in memory; rows written by an
earlier corral keep their content in `corral_files.content` and are read from there. A file may carry an
expiry (`expires_at`): past it the file is gone from listings and reads, and `sweep_expired` deletes it.

SQLite has one write lock, and a worker waiting for it fails after its busy timeout (5 s): files are
deleted, and a batch's results written, `parts_at_once` parts a transaction with a gap between two (a
hundred files of 40 MiB deleted in one transaction held it for 30 s). A file's row goes first, in one short
transaction, then its parts; parts a gateway that died part-way left behind go in `drop_orphans`. A file
written for a batch's finalising is unlinked (`write_unlinked`: its expiry `UNLINKED_AT`, so no read finds
it) until the batch's status and its files are moved in one short transaction (`link`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import IO, Any, cast

from sqlalchemy import (
    BigInteger,
    CursorResult,
    DateTime,
    Engine,
    Integer,
    LargeBinary,
    String,
    and_,
    delete,
    exists,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from corral.store.batch_rows import FINISHED, BatchRow
from corral.store.schema import Base

__all__ = [
    "PARTS_AT_ONCE",
    "PART_BYTES",
    "UNLINKED_AT",
    "FileQuotaExceeded",
    "FileRecord",
    "FileRow",
    "FileStore",
    "NewFile",
    "lock_tenant",
    "page",
    "write_file",
]

logger = logging.getLogger(__name__)

PART_BYTES = 1 << 20
PARTS_AT_ONCE = 32  # parts written or deleted a transaction (about 0.3 s of SQLite's write lock)
# the expiry of a file written but not yet given to its tenant (a batch's output while it is finalised):
# past, so no read finds it; quotas do not count it (its batch's results do) and the sweep leaves it
UNLINKED_AT = datetime(1970, 1, 1, tzinfo=UTC)
# SQLite: the gap between two of a run of transactions. A worker waiting for the write lock retries at
# most 100 ms apart (SQLite's busy handler), and the lock has no queue: without a gap it never got in
_SQLITE_GAP_S = 0.12


class FileRow(Base):
    __tablename__ = "corral_files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    size: Mapped[int] = mapped_column("bytes", BigInteger)  # (a result file passes 2 GiB: INTEGER's bound)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    content: Mapped[bytes] = mapped_column(LargeBinary)  # empty where the parts hold it
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)


class FilePartRow(Base):
    __tablename__ = "corral_file_parts"

    file_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime
    expires_at: datetime | None = None

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at.timestamp()),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": int(self.expires_at.timestamp()) if self.expires_at else None,
            "status_details": None,
        }


@dataclass(frozen=True)
class NewFile:
    """An upload to store: its content read from `source` (a file object, read a part at a time)."""

    tenant: str
    purpose: str
    filename: str
    source: IO[bytes]
    size: int
    expires_at: datetime | None = None
    # the moment its expiry was counted from: the two are told in whole seconds, so they come from one clock
    # reading (read twice, an upload told to last 3600 s could show 3599)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))


class FileStore:
    """Blocking SQL access to files (the gateway calls it from threads)."""

    def __init__(self, engine: Engine, parts_at_once: int = PARTS_AT_ONCE) -> None:
        self._engine = engine
        self._parts_at_once = parts_at_once
        self._gap_s = _SQLITE_GAP_S if engine.dialect.name == "sqlite" else 0.0

    def add_file(self, new: NewFile, quota: tuple[int, int] | None = None) -> FileRecord:
        """Store an upload. `quota`: (files, bytes) the tenant may hold with it; FileQuotaExceeded past
        either (checked in the insert's transaction)."""
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            if quota is not None:
                lock_tenant(session, new.tenant)
                _check_quota(session, new.tenant, new.size, *quota)
            row = write_file(session, new)
        return _file(row)

    def check_room(self, tenant: str, quota: tuple[int, int], adding: int) -> int:
        """FileQuotaExceeded where `tenant`'s `quota` (files, bytes) has no room for `adding` more files
        (an upload, checked before its body is read: 1) or is passed already (a batch: 0, so a tenant at
        its file count may still make a batch of its last upload), or where its bytes have reached the
        quota (an upload, or a batch: a running batch's results count as they are committed and its lines
        stop once the tenant's bytes reach the quota, so a batch made at it would run none); else the
        bytes the tenant holds."""
        with Session(self._engine) as session:
            count, held = _held(session, tenant)
        if count + adding > quota[0]:
            raise FileQuotaExceeded(f"Tenant '{tenant}' holds {count} files, its limit; delete some first.")
        if held >= quota[1]:
            raise FileQuotaExceeded(
                f"Tenant '{tenant}' holds {held:,} bytes of files and running batches' results, its limit "
                f"of {quota[1]:,}; delete some first."
            )
        return held

    def bytes_held(self, tenants: Collection[str]) -> dict[str, int]:
        """The bytes each tenant holds: its files, and the results its unfinished batches have so far."""
        with Session(self._engine) as session:
            files = session.execute(
                select(FileRow.tenant, func.sum(FileRow.size))
                .where(FileRow.tenant.in_(tenants), _linked())
                .group_by(FileRow.tenant)
            ).all()
            results = session.execute(
                select(BatchRow.tenant, func.sum(BatchRow.result_bytes))
                .where(BatchRow.tenant.in_(tenants), BatchRow.status.not_in(FINISHED))
                .group_by(BatchRow.tenant)
            ).all()
        held = dict.fromkeys(tenants, 0)
        for tenant, size in (*files, *results):
            held[tenant] += int(size or 0)
        return held

    def files(self, tenant: str, purpose: str | None, limit: int, after: str | None) -> list[FileRecord]:
        """The tenant's files, newest first; `after` a file id (pagination)."""
        return page([_file_of(r) for r in self._file_rows(tenant, purpose)], limit, after)

    def _file_rows(self, tenant: str, purpose: str | None) -> Sequence[Any]:
        query = select(*_FILE_COLUMNS).where(FileRow.tenant == tenant, _live())
        if purpose:
            query = query.where(FileRow.purpose == purpose)
        with Session(self._engine, expire_on_commit=False) as session:
            return session.execute(query.order_by(FileRow.created_at.desc(), FileRow.id)).all()

    def file(self, tenant: str, file_id: str) -> FileRecord | None:
        with Session(self._engine, expire_on_commit=False) as session:
            row = session.execute(
                select(*_FILE_COLUMNS).where(FileRow.id == file_id, FileRow.tenant == tenant, _live())
            ).first()
        return _file_of(row) if row is not None else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        """A file's whole content (batch inputs, bounded by `batch.max_file_bytes`)."""
        if self.file(tenant, file_id) is None:
            return None
        return b"".join(self.file_parts(file_id))

    def file_parts(self, file_id: str) -> Iterator[bytes]:
        """A file's content a part at a time, each read in its own query (check the tenant first)."""
        with Session(self._engine) as session:
            legacy = session.scalar(select(FileRow.content).where(FileRow.id == file_id))
        if legacy:
            yield legacy
            return
        seq = 0
        while True:
            with Session(self._engine) as session:
                data = session.scalar(
                    select(FilePartRow.data).where(FilePartRow.file_id == file_id, FilePartRow.seq == seq)
                )
            if data is None:
                return
            yield data
            seq += 1

    def delete_file(self, tenant: str, file_id: str) -> bool:
        """Delete a file: its row at once, then its parts a few a transaction."""
        with self._engine.begin() as connection:
            deleted = connection.execute(
                delete(FileRow).where(FileRow.id == file_id, FileRow.tenant == tenant, _linked())
            )
        if not _count(deleted):
            return False
        self._drop_parts([file_id])
        return True

    def sweep_expired(self, now: datetime | None = None, limit: int = 100) -> int:
        """Delete up to `limit` files past their expiry (unlinked ones are the batch store's); the number
        deleted. Their rows go in one short transaction, a row holding an earlier corral's whole content
        in one of its own, then their parts a few a transaction."""
        stamp = now or datetime.now(UTC)
        with self._engine.connect() as connection:  # (read apart: each write below takes the lock first)
            found = connection.execute(
                select(FileRow.id, func.length(FileRow.content))  # (the length, not the content, is read)
                .where(FileRow.expires_at > UNLINKED_AT, FileRow.expires_at <= stamp)
                .order_by(FileRow.expires_at)
                .limit(limit)
            ).all()
        ids = [file_id for file_id, _ in found]
        whole = [[file_id] for file_id, size in found if size]
        deleted = self._delete_rows([file_id for file_id, size in found if not size])
        for one in whole:
            self._gap()
            deleted += self._delete_rows(one)
        self._drop_parts(ids)
        return deleted

    def write_unlinked(self, new: NewFile) -> str:
        """Store a file no one sees yet (its expiry `UNLINKED_AT`; `new.expires_at` is set by `link`): its
        row, then its parts `parts_at_once` a transaction; its id. A failure part-way discards it."""
        file_id = _new_id()
        with Session(self._engine) as session, session.begin():
            session.add(_row(file_id, replace(new, expires_at=UNLINKED_AT)))
        try:
            seq = 0
            while True:
                with self._engine.begin() as connection:
                    wrote = 0
                    while wrote < self._parts_at_once and (data := new.source.read(PART_BYTES)):
                        part = insert(FilePartRow).values(file_id=file_id, seq=seq + wrote, data=data)
                        connection.execute(part)
                        wrote += 1
                seq += wrote
                if wrote < self._parts_at_once:
                    return file_id
                self._gap()
        except BaseException:
            self.discard_quietly([file_id])
            raise

    def link(self, session: Session, file_ids: Collection[str], expires_at: datetime | None) -> bool:
        """Give unlinked files to their tenant, in the caller's transaction (their expiry set): whether
        all of them were still unlinked (a pass that found their batch finished discards them)."""
        if not file_ids:
            return True
        linked = session.execute(
            update(FileRow)
            .where(FileRow.id.in_(file_ids), FileRow.expires_at == UNLINKED_AT)
            .values(expires_at=expires_at)
            .execution_options(synchronize_session=False)
        )
        return _count(linked) == len(file_ids)

    def unlinked(self) -> list[tuple[str, str]]:
        """(id, name) of the files written but not linked: being written, or left by a gateway that died."""
        with self._engine.connect() as connection:
            rows = connection.execute(
                select(FileRow.id, FileRow.filename).where(FileRow.expires_at == UNLINKED_AT)
            ).all()
        return [(file_id, name) for file_id, name in rows]

    def discard_unlinked(self, file_ids: Collection[str]) -> int:
        """Delete those of these files still unlinked (one linked meanwhile is kept), and the parts of
        those whose row is gone; how many rows were deleted."""
        if not file_ids:
            return 0
        with self._engine.begin() as connection:
            deleted = connection.execute(
                delete(FileRow).where(FileRow.id.in_(file_ids), FileRow.expires_at == UNLINKED_AT)
            )
            kept = set(connection.scalars(select(FileRow.id).where(FileRow.id.in_(file_ids))))
        self._drop_parts([file_id for file_id in file_ids if file_id not in kept])
        return _count(deleted)

    def discard_quietly(self, file_ids: Collection[str]) -> None:
        """`discard_unlinked`, a failure logged (where a write failed already: the files stay unlinked)."""
        try:
            self.discard_unlinked(file_ids)
        except Exception:
            logger.warning("files %s: discarding them failed", list(file_ids), exc_info=True)

    def drop_orphans(self, limit: int = 100) -> int:
        """Delete the parts of up to `limit` files whose row is gone (a gateway died while deleting them,
        or while writing a file discarded meanwhile); how many parts."""
        orphan = ~exists().where(FileRow.id == FilePartRow.file_id)
        with self._engine.connect() as connection:
            ids = connection.scalars(select(FilePartRow.file_id).where(orphan).distinct().limit(limit)).all()
        return self._drop_parts(ids)

    def _delete_rows(self, file_ids: list[str]) -> int:
        if not file_ids:
            return 0
        with self._engine.begin() as connection:
            return _count(connection.execute(delete(FileRow).where(FileRow.id.in_(file_ids))))

    def _drop_parts(self, file_ids: Sequence[str]) -> int:
        """Delete these files' parts (their rows gone), `parts_at_once` a transaction; how many."""
        dropped = 0
        while file_ids:
            with self._engine.connect() as connection:  # (read apart: the delete takes the lock first)
                some = connection.execute(
                    select(FilePartRow.file_id, FilePartRow.seq)
                    .where(FilePartRow.file_id.in_(file_ids))
                    .limit(self._parts_at_once)
                ).all()
            if not some:
                break
            if dropped:
                self._gap()
            parts = [and_(FilePartRow.file_id == file_id, FilePartRow.seq == seq) for file_id, seq in some]
            with self._engine.begin() as connection:
                connection.execute(delete(FilePartRow).where(or_(*parts)))
            dropped += len(some)
        return dropped

    def _gap(self) -> None:
        """Between two of a run of transactions: a worker waiting for SQLite's write lock gets it."""
        if self._gap_s:
            time.sleep(self._gap_s)


def write_file(session: Session, new: NewFile) -> FileRow:
    """Add a file and its parts to `session` (written a part at a time: one part in memory)."""
    row = _row(_new_id(), new)
    session.add(row)
    seq = 0
    while data := new.source.read(PART_BYTES):  # a core insert: the part is not kept in the session
        session.execute(insert(FilePartRow).values(file_id=row.id, seq=seq, data=data))
        seq += 1
    return row


_FILE_COLUMNS = (
    FileRow.id,
    FileRow.tenant,
    FileRow.purpose,
    FileRow.filename,
    FileRow.size,
    FileRow.created_at,
    FileRow.expires_at,
)


def _new_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def _row(file_id: str, new: NewFile) -> FileRow:
    return FileRow(
        id=file_id,
        tenant=new.tenant,
        purpose=new.purpose,
        filename=new.filename,
        size=new.size,
        created_at=new.created_at,
        content=b"",
        expires_at=new.expires_at,
    )


def _live() -> Any:
    return or_(FileRow.expires_at.is_(None), FileRow.expires_at > datetime.now(UTC))


def _linked() -> Any:
    """Files given to their tenant (quotas count them; an unlinked one is counted in its batch's row)."""
    return or_(FileRow.expires_at.is_(None), FileRow.expires_at != UNLINKED_AT)


def _count(result: Any) -> int:
    return int(cast(CursorResult[Any], result).rowcount)


class FileQuotaExceeded(Exception):
    """The tenant holds as many files, or bytes of them, as it may."""


def lock_tenant(session: Session, tenant: str) -> None:
    """Take `tenant`'s lock for the rest of the transaction, where quotas are counted and then added to:
    else concurrent transactions each count the old total (PostgreSQL's READ COMMITTED; SQLite's driver
    begins a transaction at its first write, after the count)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:tenant))"), {"tenant": tenant})
    elif dialect == "sqlite":  # a write that changes nothing takes the database's write lock now
        session.execute(text("UPDATE corral_files SET tenant = tenant WHERE 0"))


def _held(session: Session, tenant: str) -> tuple[int, int]:
    """(files, bytes) `tenant` holds: its files, and the results its unfinished batches have so far."""
    count, held = session.execute(
        select(func.count(), func.coalesce(func.sum(FileRow.size), 0)).where(
            FileRow.tenant == tenant, _linked()
        )
    ).one()
    running = session.scalar(
        select(func.coalesce(func.sum(BatchRow.result_bytes), 0)).where(
            BatchRow.tenant == tenant, BatchRow.status.not_in(FINISHED)
        )
    )
    return int(count), int(held) + int(running or 0)


def _check_quota(session: Session, tenant: str, adding: int, max_files: int, max_bytes: int) -> None:
    count, held = _held(session, tenant)
    if count + 1 > max_files:
        raise FileQuotaExceeded(f"Tenant '{tenant}' holds {count} files, its limit; delete some first.")
    if held + adding > max_bytes:
        raise FileQuotaExceeded(
            f"Tenant '{tenant}' holds {held:,} bytes of files and running batches' results; this one "
            f"({adding:,}) would pass its limit of {max_bytes:,}; delete some first."
        )


def _aware(stamp: datetime | None) -> datetime | None:
    return stamp.replace(tzinfo=UTC) if stamp is not None and stamp.tzinfo is None else stamp


def _file(row: FileRow) -> FileRecord:
    return FileRecord(
        row.id, row.tenant, row.purpose, row.filename, row.size, row.created_at, _aware(row.expires_at)
    )


def _file_of(row: Any) -> FileRecord:
    created = _aware(row.created_at)
    assert created is not None
    return FileRecord(
        row.id, row.tenant, row.purpose, row.filename, row.size, created, _aware(row.expires_at)
    )


def page(items: list[Any], limit: int, after: str | None) -> list[Any]:
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return items[:limit]
