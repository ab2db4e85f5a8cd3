"""systemd: one hardened unit running `corral up` (the gateway and the supervisor of every replica).

One unit rather than one per replica: corral's supervisor already starts, probes, restarts and stops the
replicas (process groups, parent-death signal), so systemd watches one process tree and a restart of the
unit restarts the whole cluster cleanly. GPU deployments get the device exceptions CUDA needs.
"""

from __future__ import annotations

import math
from pathlib import Path

from corral.config import ClusterSpec, LocalSource
from corral.deploy.spec_rewrite import local_services
from corral.deploy.templates import render_template

__all__ = ["CONFIG_DIR", "STATE_DIR", "render_systemd"]

CONFIG_DIR = Path("/etc/corral")
STATE_DIR = Path("/var/lib/corral")


def render_systemd(spec: ClusterSpec, source: str, spec_text: str, corral_bin: Path) -> dict[str, str]:
    """The unit, a sysusers.d entry for its user, and the spec it runs (copied as it was written)."""
    deployments = [d for m in spec.models for d in m.deployments]
    gpu = any(d.engine == "vllm" and d.device == "gpu" for d in deployments)
    # vLLM's CPU build compiles kernels at run time (oneDNN): it cannot run without W^X exceptions either.
    no_jit = not any(d.engine == "vllm" for d in deployments)
    supervisor = spec.supervisor
    context = {
        "source": source,
        "models": ", ".join(m.name for m in spec.models),
        "user": spec.deploy.user,
        "config_dir": CONFIG_DIR,
        "state_dir": STATE_DIR,
        "corral_bin": corral_bin,
        "after": _after(spec),
        "writable": sorted({str(p) for p in _local_paths(spec)}),
        "stop_seconds": math.ceil(spec.gateway.shutdown_grace + supervisor.stop_timeout + 10),
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
    """Order after the local Redis/PostgreSQL the spec uses, when they run on this host."""
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


def _protect_home(spec: ClusterSpec) -> str:
    """`yes` hides /home, /root and /run/user; model files there need them readable."""
    homes = (Path("/home"), Path("/root"), Path("/run/user"))
    local = [m.source.path for m in spec.models if isinstance(m.source, LocalSource)]
    return "read-only" if any(p.is_relative_to(h) for p in local for h in homes) else "yes"
