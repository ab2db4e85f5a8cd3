"""Production configs rendered from a cluster spec: the NGINX edge, systemd, Compose and KubeRay, plus
development certificates. Tools: nothing here imports the gateway."""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Literal

from corral.config import ClusterSpec
from corral.deploy.certs import CertificateError, DevCertificates, write_dev_certificates
from corral.deploy.compose import render_compose
from corral.deploy.kuberay import render_kuberay
from corral.deploy.nginx import render_nginx
from corral.deploy.spec_rewrite import RenderError
from corral.deploy.systemd import render_systemd

__all__ = [
    "TARGETS",
    "CertificateError",
    "DevCertificates",
    "RenderError",
    "Target",
    "render",
    "write_dev_certificates",
    "write_rendered",
]

Target = Literal["nginx", "systemd", "compose", "kuberay"]
# Copies of the spec (systemd/, compose/), the KubeRay manifest carrying it, Prometheus's scrape token: by
# their path under the output folder (by name alone, Grafana's provisioning files named corral.yaml were
# made private too, and Grafana, another user, could not read them).
PRIVATE_FILES = ("*/cluster.yaml", "kuberay/corral.yaml", "prometheus/metrics.token", "compose/metrics.token")
TARGETS: tuple[Target, ...] = ("nginx", "systemd", "compose", "kuberay")


def render(
    spec: ClusterSpec, target: Target, source: str, spec_text: str, corral_bin: Path
) -> dict[str, str]:
    """The files of `target` for `spec`, keyed by their path relative to the output folder."""
    if target == "nginx":
        return render_nginx(spec, source)
    if target == "systemd":
        return render_systemd(spec, source, spec_text, corral_bin)
    if target == "compose":
        return render_compose(spec, source)
    return render_kuberay(spec, source)


def write_rendered(files: dict[str, str], directory: Path) -> list[Path]:
    """Write the files; copies of the spec (it may hold keys and passwords) and manifests carrying it are
    readable by their owner only."""
    written = []
    for relative, text in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new file: someone else's file there would keep its owner and mode, and one an earlier render
        # made private by mistake (Grafana's provisioning files) would stay unreadable to its reader.
        path.unlink(missing_ok=True)
        if _private(relative):  # made private, never readable by others for a moment
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
        else:
            path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def _private(relative: str) -> bool:
    path = PurePosixPath(relative).as_posix()
    return any(fnmatchcase(path, pattern) for pattern in PRIVATE_FILES)
