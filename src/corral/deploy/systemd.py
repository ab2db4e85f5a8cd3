"""systemd: one hardened unit running `corral up` (the gateway and the supervisor of every replica).

One unit rather than one per replica: corral's supervisor already starts, probes, restarts and stops the
replicas (process groups, parent-death signal), so systemd watches one process tree and a restart of the
unit restarts the whole cluster cleanly. GPU deployments get the device exceptions CUDA needs.
"""

from __future__ import annotations

from pathlib import Path

from corral.config import ClusterSpec
from corral.deploy.spec_rewrite import RenderError, local_files, local_services, stop_allowance_s
from corral.deploy.templates import render_template

__all__ = ["CONFIG_DIR", "STATE_DIR", "render_systemd"]

CONFIG_DIR = Path("/etc/corral")
STATE_DIR = Path("/var/lib/corral")


def render_systemd(spec: ClusterSpec, source: str, spec_text: str, corral_bin: Path) -> dict[str, str]:
    """The unit, a sysusers.d entry for its user, and the spec it runs (copied as it was written).
    RenderError for a path the service could not see as the host does."""
    _check_visible(spec, corral_bin)
    deployments = [d for m in spec.models for d in m.deployments]
    gpu = any(d.engine == "vllm" and d.device == "gpu" for d in deployments)
    # vLLM's CPU build compiles kernels at run time (oneDNN): it cannot run without W^X exceptions either.
    no_jit = not any(d.engine == "vllm" for d in deployments)
    context = {
        "source": source,
        "models": ", ".join(m.name for m in spec.models),
        "user": spec.deploy.user,
        "config_dir": CONFIG_DIR,
        "state_dir": STATE_DIR,
        "corral_bin": corral_bin,
        "after": _after(spec),
        "writable": sorted({str(p) for p in _local_paths(spec)}),
        "stop_seconds": stop_allowance_s(spec),
        "port": spec.gateway.port,
        "low_port": 0 < spec.gateway.port < 1024,
        "gpu": gpu,
        "no_jit": no_jit,
        "protect_home": _protect_home(spec),
    }
    user = spec.deploy.user
    return {
        "systemd/corral.service": render_template("corral.service.j2", context),
        "systemd/sysusers.d/corral.conf": f'u {user} - "corral inference cluster" {STATE_DIR}\n',
        "systemd/cluster.yaml": spec_text,
    }


def _after(spec: ClusterSpec) -> list[str]:
    """Order after the local Redis (limits, cache, batch queue) and PostgreSQL the spec uses, when they run
    on this host."""
    unit = {"redis": "redis-server.service", "postgres": "postgresql.service"}
    return [unit[name] for name in sorted(local_services(spec), reverse=True)]


def _local_paths(spec: ClusterSpec) -> list[Path]:
    """A SQLite store outside the state directory must stay writable under ProtectSystem=strict (a
    relative path is relative to the unit's working directory, the state directory)."""
    url = spec.store.url or ""
    if url.startswith("sqlite:///"):
        folder = (STATE_DIR / url.removeprefix("sqlite:///")).parent
        if not folder.is_relative_to(STATE_DIR):
            return [folder]
    return []


_PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))
_HOMES = (Path("/home"), Path("/root"), Path("/run/user"))


def _read_files(spec: ClusterSpec) -> list[tuple[str, Path]]:
    """What the service reads from this host's files for its engines: model weights, tokenizers, LoRA
    adapters and engine programs (`binary`), each with the field naming it. (A relative path is relative
    to the unit's working directory, the state directory, which the service sees.)"""
    binaries = [
        (f"model {model.name!r}'s {deployment.engine} binary", deployment.binary)
        for model in spec.models
        for deployment in model.deployments
        if deployment.binary is not None
    ]
    return local_files(spec) + binaries


def _check_visible(spec: ClusterSpec, corral_bin: Path) -> None:
    """The unit's PrivateTmp=yes gives the service its own empty /tmp and /var/tmp, and ProtectHome hides
    the home folders unless a file the engines read lives there (then read-only): the program, a SQLite
    store and the engines' files in those places would not be what the host sees."""
    if _under(corral_bin, _PRIVATE_TMP + _HOMES):
        raise RenderError(
            f"the unit would run {corral_bin}, which the service cannot see (PrivateTmp=yes gives it its own "
            "/tmp and /var/tmp; ProtectHome= hides /home, /root and /run/user): install corral outside them "
            "(e.g. `python3 -m venv /opt/corral/.venv && /opt/corral/.venv/bin/pip install .` in your "
            "checkout) and pass --corral-bin /opt/corral/.venv/bin/corral"
        )
    url = spec.store.url or ""
    store = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
    if store is not None and store.is_absolute() and _under(store, _PRIVATE_TMP + _HOMES):
        raise RenderError(
            f"store.url puts the SQLite store in {store.parent}, which the service sees as its own private "
            "folder (PrivateTmp=yes, ProtectHome=): keys made on the host would never be seen, and usage "
            "written there is lost on restart. Leave store.url unset (the state directory "
            f"{STATE_DIR}) or name a path under it"
        )
    for field, path in _read_files(spec):
        if _under(path, _PRIVATE_TMP):
            raise RenderError(
                f"{field} {path} is in a temporary folder, which the service sees empty (PrivateTmp=yes): "
                "move it (e.g. under /var/lib/corral/models) and render again"
            )


def _under(path: Path, folders: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def _protect_home(spec: ClusterSpec) -> str:
    """`yes` hides /home, /root and /run/user; the engines' files (weights, tokenizers, adapters,
    programs) there need them readable."""
    return "read-only" if any(_under(path, _HOMES) for _, path in _read_files(spec)) else "yes"
