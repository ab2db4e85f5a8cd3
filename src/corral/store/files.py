"""Uploaded and produced files (the Files API): content kept in the SQL store, per tenant."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, Engine, Integer, LargeBinary, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from corral.store.schema import Base

__all__ = ["FileQuotaExceeded", "FileRecord", "FileRow", "FileStore", "page"]


class FileRow(Base):
    __tablename__ = "corral_files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    size: Mapped[int] = mapped_column("bytes", Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    content: Mapped[bytes] = mapped_column(LargeBinary)


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at.timestamp()),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


class FileStore:
    """Blocking SQL access to files (the gateway calls it from threads)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def add_file(
        self,
        tenant: str,
        purpose: str,
        filename: str,
        content: bytes,
        quota: tuple[int, int] | None = None,
    ) -> FileRecord:
        """Store an upload. `quota`: (files, bytes) the tenant may hold with it; FileQuotaExceeded past
        either (checked in the insert's transaction)."""
        row = FileRow(
            id=f"file-{uuid.uuid4().hex[:24]}",
            tenant=tenant,
            purpose=purpose,
            filename=filename,
            size=len(content),
            created_at=datetime.now(UTC),
            content=content,
        )
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            if quota is not None:
                _check_quota(session, tenant, len(content), *quota)
            session.add(row)
        return _file(row)

    def files(self, tenant: str, purpose: str | None, limit: int, after: str | None) -> list[FileRecord]:
        """The tenant's files, newest first; `after` a file id (pagination)."""
        return page([_file_of(r) for r in self._file_rows(tenant, purpose)], limit, after)

    def _file_rows(self, tenant: str, purpose: str | None) -> Sequence[Any]:
        query = select(*_FILE_COLUMNS).where(FileRow.tenant == tenant)
        if purpose:
            query = query.where(FileRow.purpose == purpose)
        with Session(self._engine, expire_on_commit=False) as session:
            return session.execute(query.order_by(FileRow.created_at.desc(), FileRow.id)).all()

    def file(self, tenant: str, file_id: str) -> FileRecord | None:
        with Session(self._engine, expire_on_commit=False) as session:
            row = session.execute(
                select(*_FILE_COLUMNS).where(FileRow.id == file_id, FileRow.tenant == tenant)
            ).first()
        return _file_of(row) if row is not None else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        with Session(self._engine, expire_on_commit=False) as session:
            return session.scalar(
                select(FileRow.content).where(FileRow.id == file_id, FileRow.tenant == tenant)
            )

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with Session(self._engine, expire_on_commit=False) as session, session.begin():
            row = session.get(FileRow, file_id)
            if row is None or row.tenant != tenant:
                return False
            session.delete(row)
        return True


_FILE_COLUMNS = (
    FileRow.id,
    FileRow.tenant,
    FileRow.purpose,
    FileRow.filename,
    FileRow.size,
    FileRow.created_at,
)


class FileQuotaExceeded(Exception):
    """The tenant holds as many files, or bytes of them, as it may."""


def _check_quota(session: Session, tenant: str, adding: int, max_files: int, max_bytes: int) -> None:
    count, held = session.execute(
        select(func.count(), func.coalesce(func.sum(FileRow.size), 0)).where(FileRow.tenant == tenant)
    ).one()
    if count + 1 > max_files:
        raise FileQuotaExceeded(f"Tenant '{tenant}' holds {count} files, its limit; delete some first.")
    if held + adding > max_bytes:
        raise FileQuotaExceeded(
            f"Tenant '{tenant}' holds {held:,} bytes of files; this one ({adding:,}) would pass its limit of "
            f"{max_bytes:,}; delete some first."
        )


def _file(row: FileRow) -> FileRecord:
    return FileRecord(row.id, row.tenant, row.purpose, row.filename, row.size, row.created_at)


def _file_of(row: Any) -> FileRecord:
    created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
    return FileRecord(row.id, row.tenant, row.purpose, row.filename, row.size, created)


def page(items: list[Any], limit: int, after: str | None) -> list[Any]:
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return items[:limit]
