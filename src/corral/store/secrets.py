"""Server secrets kept in the store: made once, at random, by the first gateway that asks, and the same for
every gateway and worker that shares the store (a secret made per process would differ between them)."""

from __future__ import annotations

import secrets

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from corral.store.schema import SecretRow

__all__ = ["server_secret"]


def server_secret(engine: Engine, name: str) -> str:
    """The store's secret called `name` (64 hex digits), made now where there is none."""
    with Session(engine) as session:
        found = session.get(SecretRow, name)
        if found is not None:
            return found.value
    try:
        with Session(engine) as session, session.begin():
            session.add(SecretRow(name=name, value=secrets.token_hex(32)))
    except IntegrityError:  # another gateway made it first: its secret stands
        pass
    with Session(engine) as session:
        made = session.get(SecretRow, name)
        assert made is not None
        return made.value
