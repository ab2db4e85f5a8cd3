"""Signing in to the console through a real OpenID provider (oidc-provider-mock, Authlib's server) in
headless Chromium: a tenant-admin signs in on the provider's login page, creates a key in the console that
then works on the API and sees only its tenant's keys; a viewer's console changes are refused (the role,
and without the CSRF token the session); every step is on the audit trail."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import openai
import pytest
from oidc_provider_mock import User, run_server_in_thread
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import RunningCluster, cluster_of
from tests.gateway.test_console import browser, errors  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

ADMIN = "signin-admin-key"
SPEC = """
supervisor: {{probe_interval: 0.5}}
auth:
  open: false
  admin_key: {admin}
  oidc:
    issuer: {issuer}
    client_id: corral
    client_secret: not-a-secret
    audience: corral-api
    groups: {{ops-team: {{tenant: ops, role: viewer}}}}
    tenants: {{acme: {{rpm: 10}}, ops: {{}}}}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {{engine: sim, replicas: 1, gpu: h100-sxm, time_scale: 20}}
"""
PEOPLE = [
    User(sub="bob", claims={"tenant": "acme", "role": "tenant-admin"}),
    User(sub="carol", claims={"groups": ["ops-team"]}),
]


@pytest.fixture(scope="module")
def provider() -> Iterator[str]:
    with run_server_in_thread(user_claims=PEOPLE) as server:
        yield f"http://localhost:{server.server_port}"


def sign_in(chrome: webdriver.Chrome, cluster: RunningCluster, who: str) -> WebDriverWait:
    chrome.get(cluster.url + "/console")
    wait = WebDriverWait(chrome, 30, poll_frequency=0.2)
    wait.until(lambda b: b.find_element(By.ID, "signin").is_displayed())
    chrome.find_element(By.ID, "signin").click()
    wait.until(lambda b: b.find_elements(By.NAME, "sub"))  # the provider's own login page
    field = chrome.find_element(By.CSS_SELECTOR, "input[name=sub]")
    field.send_keys(who)
    field.submit()
    wait.until(lambda b: who in b.find_element(By.ID, "who").text)
    return wait


def admin_get(cluster: RunningCluster, path: str) -> dict:
    request = urllib.request.Request(cluster.url + path, headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return dict(json.load(answer))


def test_a_tenant_admin_signs_in_and_makes_a_key_a_viewer_is_refused_a_change(
    tmp_path: Path,
    browser: webdriver.Chrome,  # noqa: F811  (the fixture imported above)
    provider: str,
) -> None:
    browser.delete_all_cookies()
    started = datetime.now(UTC).isoformat()
    with cluster_of(tmp_path, SPEC.format(admin=ADMIN, issuer=provider), admin_key=ADMIN) as cluster:
        wait = sign_in(browser, cluster, "bob")
        assert browser.find_element(By.ID, "who").text == "bob (tenant-admin, acme)"
        assert browser.find_element(By.ID, "keys-section").is_displayed()
        assert not browser.find_element(By.ID, "traffic-section").is_displayed()  # not a tenant-admin's
        browser.find_element(By.ID, "new-key-name").send_keys("made in the console")
        browser.find_element(By.ID, "new-key-rpm").send_keys("5")
        browser.find_element(By.CSS_SELECTOR, "#new-key button").click()
        wait.until(lambda b: b.find_element(By.ID, "secret").text.startswith("sk-corral-"))
        secret = browser.find_element(By.ID, "secret").text
        client = openai.OpenAI(base_url=cluster.base_url, api_key=secret, max_retries=0)
        reply = client.chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        wait.until(lambda b: "made in the console" in b.find_element(By.ID, "keys").text)
        rows = browser.find_elements(By.CSS_SELECTOR, "#keys tbody tr")
        assert rows and all("acme" in row.text for row in rows)
        assert [e for e in errors(browser) if cluster.url in e] == []  # (not the provider's pages')

        browser.find_element(By.ID, "signout").click()  # the session ends; so does the provider's
        wait.until(lambda b: b.current_url.startswith(provider + "/oauth2/end_session"))
        asked = urllib.parse.parse_qs(urllib.parse.urlsplit(browser.current_url).query)
        assert asked["client_id"] == ["corral"] and asked["id_token_hint"][0].count(".") == 2
        assert "id_token_hint</code> not set" not in browser.page_source  # (the provider's own warning)
        browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()  # "End session"
        wait.until(lambda b: b.current_url == cluster.url + "/console")  # post_logout_redirect_uri
        sign_in(browser, cluster, "carol")
        assert browser.find_element(By.ID, "who").text == "carol (viewer, ops)"
        change = """
            const done = arguments[arguments.length - 1];
            const headers = arguments[0] ? {"X-CSRF-Token": arguments[0]} : {};
            fetch("/admin/spec", {method: "POST", headers, body: "models: []"})
              .then((r) => r.json().then((b) => done([r.status, b.error.code])));
        """
        csrf = browser.execute_script("return state.me.csrf")
        assert browser.execute_async_script(change, csrf) == [403, "role_not_allowed"]
        assert browser.execute_async_script(change, "") == [403, "csrf_failed"]

        since = urllib.parse.quote(started)
        # (the store is the suite's: other tests' actions are on it too, more than a listing's default 100
        # while the other test worker runs; the most a listing returns keeps bob's first ones in it)
        trail = admin_get(cluster, f"/admin/audit?since={since}&limit=1000")["entries"]
        people = ("oidc:bob", "oidc:carol")
        said = [
            (e["action"], e["actor"], e["role"], e["status"]) for e in reversed(trail) if e["actor"] in people
        ]
        assert said == [
            ("signin", "oidc:bob", "tenant-admin", 303),
            ("key.create", "oidc:bob", "tenant-admin", 201),
            ("signout", "oidc:bob", "tenant-admin", 200),
            ("signin", "oidc:carol", "viewer", 303),
            ("spec.apply", "oidc:carol", "viewer", 403),
            ("spec.apply", "oidc:carol", "viewer", 403),
        ]
