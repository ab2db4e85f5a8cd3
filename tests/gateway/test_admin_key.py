"""The admin key as an operator writes it: an empty one (a template's unset variable) or one that no client
can send is refused where it is read (the spec, CORRAL_ADMIN_KEY); and a gateway never takes a bare
`Authorization: Bearer` for an admin key, whatever it was built with."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import make_mocked_request

from corral.cli.app import CliError
from corral.cli.gateway_spec import gateway_parts_for
from corral.cluster.preflight import preflight
from corral.config import AuthSettings, Paths, SpecError, admin_key_from_env, parse_spec
from corral.gateway.admin import AdminViews
from corral.routing import ReplicaSet, Router

from .conftest import make_services

SPEC = "auth:\n  admin_key: {key}\nmodels:\n  - name: m\n    deployments: [{{engine: external, urls: [http://h]}}]\n"


@pytest.mark.parametrize("key", ['""', '" "', '"two words"', '"naïve"'])
def test_an_admin_key_no_client_can_send_is_refused_naming_the_setting(key: str) -> None:
    with pytest.raises(
        SpecError, match=r"c.yaml:2: auth.admin_key: .*visible ASCII characters, without spaces"
    ):
        parse_spec(SPEC.format(key=key), source="c.yaml")
    assert parse_spec(SPEC.format(key="k"), source="c.yaml").auth.admin_key == "k"


def test_an_admin_key_from_the_environment_that_no_client_can_send_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_spec(SPEC.format(key="from-the-spec"))
    monkeypatch.setenv("CORRAL_ADMIN_KEY", "has a space")
    with pytest.raises(CliError, match="CORRAL_ADMIN_KEY must be visible ASCII"):
        gateway_parts_for(spec, Paths(home=tmp_path), ReplicaSet(["m"]))
    # (found before anything is fetched, with every other problem of the spec)
    assert "CORRAL_ADMIN_KEY: must be visible ASCII characters, without spaces" in preflight(
        spec, gateway=True
    )


def test_an_admin_key_from_a_file_keeps_no_line_break(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kubernetes Secret made from `openssl rand -hex 24 > admin.key` gives the variable the file's last
    line break: the key is the line, as a client sends it."""
    monkeypatch.setenv("CORRAL_ADMIN_KEY", "0123abcd\n")
    assert admin_key_from_env("from-the-spec") == "0123abcd"
    assert preflight(parse_spec(SPEC.format(key="k")), gateway=True) == []


@pytest.mark.parametrize("header", ["Bearer", "Bearer ", "bearer  "])
def test_a_bearer_without_a_token_is_never_the_admin_key(tmp_path: Path, header: str) -> None:
    """A gateway built with an empty admin key (a library caller's, past the spec's check) takes no bare
    `Bearer` for it: before, such a header was a full admin."""
    parts = make_services(ReplicaSet(["m"]), tmp_path / "c.db", auth=AuthSettings(), admin_key="")
    views = AdminViews(
        access=parts.access,
        keys=parts.keys,
        usage=parts.usage_store,
        router=Router(ReplicaSet(["m"])),
        queue_depths=parts.queue.depths,
    )
    request = make_mocked_request("GET", "/admin/keys", headers={"Authorization": header})
    assert views.is_admin(request) is False
