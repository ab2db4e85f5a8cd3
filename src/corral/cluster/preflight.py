"""What a spec needs beyond being valid, checked before anything is fetched, built, started or changed:
every problem at once, each naming its field and its file or URL. Found only later, a missing local model
ended `corral up` after llama-server's six-minute build, a missing certificate after every model was
fetched, and a tokenizer a live apply could not load left it half made.

`preflight` always checks how the URLs are written (`store.url` as SQLAlchemy reads it, the Redis URLs);
on this machine, the files the models name (local sources, engine `binary`, tokenizers: of every model,
or of those given), the gateway's certificate and key (`gateway`), and whether the store answers
(`store_url`, reached without writing to it: `corral up` makes its tables)."""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterator
from pathlib import Path

from corral.config import ClusterSpec, LocalSource, ModelSpec, admin_key_from_env
from corral.config.auth import sendable_token

__all__ = ["preflight"]

_STORE_TIMEOUT_S = 5  # a PostgreSQL server that does not answer, reported in seconds (not the OS's minutes)
_STORE_FORMS = "sqlite:///PATH or postgresql://USER@HOST/DB"


def preflight(
    spec: ClusterSpec,
    *,
    models: Collection[str] | None = None,
    gateway: bool = False,
    store_url: str | None = None,
) -> list[str]:
    """Every problem found, as `field: file or value: why`: the URLs as written; the files of the models
    named in `models` (of every model when None; none for an empty collection); with `gateway`, its TLS
    certificate and key; with `store_url`, whether that store answers (blocking: up to 5 s)."""
    problems = list(_url_problems(spec))
    for index, model in enumerate(spec.models):
        if models is None or model.name in models:
            problems += _model_problems(spec, index, model)
    if gateway and (key := admin_key_from_env(spec.auth.admin_key)) is not None and not sendable_token(key):
        problems.append("CORRAL_ADMIN_KEY: must be visible ASCII characters, without spaces")
    if gateway and spec.gateway.tls is not None:
        tls = spec.gateway.tls
        problems += [
            f"gateway.tls.{field}: {path}: {why}"
            for field, path in (("cert", tls.cert), ("key", tls.key))
            if (why := _unreadable(path)) is not None
        ]
    if store_url is not None and _store_url_problem(store_url) is None:  # (a malformed one is said above)
        problem = _store_unreachable(store_url)
        if problem is not None:
            problems.append(f"store.url: {problem}")
    return problems


def _url_problems(spec: ClusterSpec) -> Iterator[str]:
    from redis.connection import parse_url

    if spec.store.url is not None:
        problem = _store_url_problem(spec.store.url)
        if problem is not None:
            yield f"store.url: {problem}"
    sections = (("limits", spec.limits.redis_url), ("cache", spec.cache.redis_url))
    for section, url in (*sections, ("batch", spec.batch.redis_url)):
        try:
            parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError as exc:
            yield f"{section}.redis_url: {_without_password(url)!r} is not a Redis URL ({exc})"


def _store_url_problem(url: str) -> str | None:
    """Why SQLAlchemy cannot read `url` as a database's, or None."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from corral.store import normalise_url

    try:
        make_url(normalise_url(url)).get_dialect()
    except ArgumentError:
        return f"{_without_password(url)!r} is not a database URL ({_STORE_FORMS})"
    except NoSuchModuleError:
        return f"{_without_password(url)!r}: no such kind of database ({_STORE_FORMS})"
    return None


def _model_problems(spec: ClusterSpec, index: int, model: ModelSpec) -> Iterator[str]:
    """The files a model names that this machine lacks: its local source, its adapters', its engines'
    programs (not where Ray's nodes run an image of their own: `ray.shared_files: false`), its tokenizer."""
    where = f"models[{index}]"
    if isinstance(model.source, LocalSource) and not model.source.path.expanduser().exists():
        yield f"{where}.source.path: {model.source.path}: no such file or folder"
    for number, adapter in enumerate(model.adapters):
        source = adapter.source
        if isinstance(source, LocalSource) and not source.path.expanduser().exists():
            yield f"{where}.adapters[{number}].source.path: {source.path}: no such file or folder"
    on_own_host = spec.ray is None or spec.ray.shared_files
    for number, deployment in enumerate(model.deployments):
        binary = deployment.binary
        if binary is None or not on_own_host or deployment.engine not in ("llamacpp", "vllm"):
            continue
        field = f"{where}.deployments[{number}].binary: {binary}"
        if not binary.exists():
            yield f"{field}: no such file"
        elif deployment.engine == "llamacpp" and not (binary.is_file() and os.access(binary, os.X_OK)):
            yield f"{field}: not an executable file (llama-server)"
    if model.tokenizer is not None:
        problem = _tokenizer_problem(model.tokenizer)
        if problem is not None:
            yield f"{where}.tokenizer: {model.tokenizer}: {problem}"


def _tokenizer_problem(path: Path) -> str | None:
    """Why the gateway could not load a tokenizer (loaded as it loads it), or None."""
    from corral.admission import TokenCounter

    if not path.is_file():
        return "no such file (a Hugging Face tokenizer.json on the machine corral up runs on)"
    try:
        TokenCounter(path)
    except Exception as exc:  # (the tokenizers library raises Exception itself, whatever is wrong)
        return f"not a tokenizer.json the tokenizers library can read: {exc}"
    return None


def _unreadable(path: Path) -> str | None:
    if not path.is_file():
        return "no such file"
    if not os.access(path, os.R_OK):
        return "cannot be read by this user"
    return None


def _store_unreachable(url: str) -> str | None:
    """Why the store at `url` cannot be used from here, or None: a SQLite file's folder must exist or be
    creatable, a server must answer a connection (nothing is written: the gateway makes the tables)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from corral.store import normalise_url

    parsed = make_url(normalise_url(url))
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_unusable(Path(parsed.database or "").expanduser()) if parsed.database else None
    shown = _without_password(url)
    postgres = parsed.get_backend_name() == "postgresql"
    try:
        engine = create_engine(parsed, connect_args={"connect_timeout": _STORE_TIMEOUT_S} if postgres else {})
    except ImportError:
        return f"no driver for {shown} ({_STORE_FORMS})"
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as exc:
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        return f"cannot reach {shown}: {cause}"
    finally:
        engine.dispose()
    return None


def _sqlite_unusable(path: Path) -> str | None:
    if path.exists():
        return None if os.access(path, os.R_OK | os.W_OK) else f"{path}: cannot be written by this user"
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        return f"{path}: cannot be created ({folder} is not a folder this user can write in)"
    return None


def _without_password(url: str) -> str:
    """`url` with any password in it hidden (a URL that does not parse is shown in the error)."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)
