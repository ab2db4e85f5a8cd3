"""Files in the store: a result file of 2 GiB or more has its size kept on PostgreSQL, in a store made
before the size column was widened too (brought forward when corral opens it)."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.orm import Session
from sqlalchemy.types import BigInteger

from corral.store import open_database
from corral.store.files import FileStore, NewFile, write_file

POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432"


@pytest.fixture
def postgres() -> Iterator[str]:
    """A fresh PostgreSQL database of this test's own (the server on 127.0.0.1:5432), dropped after it."""
    name = f"corral_files_{uuid.uuid4().hex[:12]}"
    server = create_engine(POSTGRES + "/test", isolation_level="AUTOCOMMIT")
    with server.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield f"{POSTGRES}/{name}"
    finally:
        with server.connect() as connection:
            connection.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        server.dispose()


def test_a_file_of_2_gib_is_kept_in_a_store_made_with_a_4_byte_size_column(postgres: str) -> None:
    """`corral_files.bytes` was an INTEGER: a batch's output of 2 GiB could not be stored
    (NumericValueOutOfRange), and its finalising failed every pass. A store made so is widened to BIGINT
    as corral opens it."""
    engine = open_database(postgres)
    with engine.begin() as connection:  # as an earlier corral made it
        connection.execute(text("ALTER TABLE corral_files ALTER COLUMN bytes TYPE INTEGER"))
    engine.dispose()
    engine = open_database(postgres)
    (size,) = [c["type"] for c in inspect(engine).get_columns("corral_files") if c["name"] == "bytes"]
    assert isinstance(size, BigInteger)
    with Session(engine) as session, session.begin():  # (its parts hold 3 bytes: the size is what is told)
        new = NewFile("acme", "batch_output", "out.jsonl", io.BytesIO(b"{}\n"), 2**31 + 5)
        file_id = write_file(session, new).id
    found = FileStore(engine).file("acme", file_id)
    assert found is not None and found.bytes == 2**31 + 5
    engine.dispose()
