"""The identity provider's issuer is https, or http on this machine only, as a URL parser reads its host:
a user name before an `@` does not make a remote provider local."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from corral.config import OIDCSettings


@pytest.mark.parametrize(
    "issuer",
    [
        "http://localhost:1@idp.example.net/realms/x",  # (the host is idp.example.net; "localhost" a user)
        "http://127.0.0.1@idp.example.net",
        "https://user:password@idp.example.net/realms/x",  # (no credentials in an issuer, https or not)
        "http://localhost.example.net/realms/x",
        "http://idp.example.net",
        "https://idp.example.net/realms/x?localhost",
        "https:///realms/x",
    ],
)
def test_an_issuer_that_is_not_https_or_local_or_names_a_user_is_refused(issuer: str) -> None:
    with pytest.raises(ValidationError, match=r"auth\.oidc\.issuer"):
        OIDCSettings(issuer=issuer, client_id="corral")


@pytest.mark.parametrize(
    "issuer",
    [
        "https://login.example.com/realms/corral",
        "https://accounts.google.com",
        "http://localhost:8080/realms/x",
        "http://127.0.0.1:9000",
        "http://[::1]:8080",
    ],
)
def test_an_https_or_local_issuer_is_taken(issuer: str) -> None:
    assert OIDCSettings(issuer=issuer, client_id="corral").issuer == issuer
