"""Files in the store: a result file of 2 GiB or more has its size kept on PostgreSQL, in a store made
before the size column was widened too (brought forward when corral opens it)."""

from __future__ import annotations

import io

from sqlalchemy import inspect, text
from sqlalchemy.orm import Session
from sqlalchemy.types import BigInteger

from corral.store import open_database
from corral.store.files import FileStore, NewFile, write_file


def test_a_file_of_2_gib_is_kept_in_a_store_made_with_a_4_byte_size_column(fresh_postgres: str) -> None:
    """`corral_files.bytes` was an INTEGER: a batch's output of 2 GiB could not be stored
    (NumericValueOutOfRange), and its finalising failed every pass. A store made so is widened to BIGINT
    as corral opens it."""
    engine = open_database(fresh_postgres)
    with engine.begin() as connection:  # as an earlier corral made it
        connection.execute(text("ALTER TABLE corral_files ALTER COLUMN bytes TYPE INTEGER"))
    engine.dispose()
    engine = open_database(fresh_postgres)
    (size,) = [c["type"] for c in inspect(engine).get_columns("corral_files") if c["name"] == "bytes"]
    assert isinstance(size, BigInteger)
    with Session(engine) as session, session.begin():  # (its parts hold 3 bytes: the size is what is told)
        new = NewFile("acme", "batch_output", "out.jsonl", io.BytesIO(b"{}\n"), 2**31 + 5)
        file_id = write_file(session, new).id
    found = FileStore(engine).file("acme", file_id)
    assert found is not None and found.bytes == 2**31 + 5
    engine.dispose()
