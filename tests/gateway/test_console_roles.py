"""The console in headless Chromium with a real OpenID provider (oidc-provider-mock): a signed-in
operator's figures go on moving poll after poll (the panels its role may not read are not asked for), a
viewer's key given in the admin key box has the panels the gateway refuses left out and named while the
others go on, and a session that ends while the page is open offers the sign-in again, not the admin key;
signing out of an ended session goes back to the console."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from oidc_provider_mock import User, run_server_in_thread
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import RunningCluster, cluster_of
from tests.gateway.test_console import browser, errors, number  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

ADMIN = "roles-admin-key"
SPEC = """
supervisor: {{probe_interval: 0.5}}
auth:
  open: false
  admin_key: {admin}
  oidc:
    issuer: {issuer}
    client_id: corral
    client_secret: not-a-secret
    groups: {{ops-team: {{tenant: ops, role: viewer}}}}
    tenants: {{ops: {{}}}}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {{engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 20}}
"""
PEOPLE = [
    User(sub="olive", claims={"tenant": "ops", "role": "operator"}),
    User(sub="carol", claims={"groups": ["ops-team"]}),
]


@pytest.fixture(scope="module")
def provider() -> Iterator[str]:
    with run_server_in_thread(user_claims=PEOPLE) as server:
        yield f"http://localhost:{server.server_port}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, provider: str) -> Iterator[RunningCluster]:
    spec = SPEC.format(admin=ADMIN, issuer=provider)
    with cluster_of(tmp_path_factory.mktemp("roles"), spec, admin_key=ADMIN) as running:
        yield running


def sign_in(chrome: webdriver.Chrome, cluster: RunningCluster, who: str) -> WebDriverWait:
    chrome.get(cluster.url + "/console")
    chrome.delete_all_cookies()  # (no one signed in from an earlier test)
    chrome.execute_script("sessionStorage.clear()")
    chrome.refresh()
    wait = WebDriverWait(chrome, 30, poll_frequency=0.2)
    wait.until(lambda b: b.find_element(By.ID, "signin").is_displayed())
    chrome.find_element(By.ID, "signin").click()
    wait.until(lambda b: b.find_elements(By.NAME, "sub"))  # the provider's own login page
    field = chrome.find_element(By.CSS_SELECTOR, "input[name=sub]")
    field.send_keys(who)
    field.submit()
    wait.until(lambda b: who in b.find_element(By.ID, "who").text)
    return wait


def api_key(cluster: RunningCluster, role: str = "user") -> str:
    made = urllib.request.Request(
        cluster.url + "/admin/keys",
        data=json.dumps({"tenant": "ops", "role": role}).encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(made, timeout=10) as answer:
        return str(json.load(answer)["key"])


def load(cluster: RunningCluster, secret: str, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        client = openai.OpenAI(base_url=cluster.base_url, api_key=secret)
        while not stop.is_set():
            client.chat.completions.create(
                model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=16
            )

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_an_operators_console_keeps_polling_without_the_keys_panel(
    cluster: RunningCluster,
    browser: webdriver.Chrome,  # noqa: F811  (the fixture imported above)
) -> None:
    wait = sign_in(browser, cluster, "olive")
    assert browser.find_element(By.ID, "who").text == "olive (operator, ops)"
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#replicas tbody tr td.ready")) == 2)
    stop = threading.Event()
    secret = api_key(cluster)
    users = [load(cluster, secret, stop) for _ in range(2)]
    try:
        wait.until(lambda b: (number(b, "rps") or 0) > 0)  # two polls apart: a rate
        seen = {browser.find_element(By.ID, "rps").text}
        for _ in range(3):  # and it goes on moving, poll after poll
            wait.until(lambda b: b.find_element(By.ID, "rps").text not in seen)
            seen.add(browser.find_element(By.ID, "rps").text)
    finally:
        stop.set()
        for thread in users:
            thread.join(timeout=30)
    assert browser.find_element(By.ID, "status").text.startswith("live")
    assert not browser.find_element(By.ID, "login").is_displayed()  # no admin key asked of a signed-in one
    assert not browser.find_element(By.ID, "keys-section").is_displayed()  # keys:read is not an operator's
    assert browser.find_element(By.ID, "tenants-section").is_displayed()  # usage:read is
    assert browser.find_element(By.ID, "audit-section").is_displayed()
    assert not browser.find_element(By.ID, "not-for-role").is_displayed()  # nothing asked was refused
    assert [e for e in errors(browser) if cluster.url in e] == []  # (no 403: nothing it may not read)


def test_a_session_that_ends_offers_the_sign_in_again(
    cluster: RunningCluster,
    browser: webdriver.Chrome,  # noqa: F811  (the fixture imported above)
) -> None:
    wait = sign_in(browser, cluster, "carol")
    assert browser.find_element(By.ID, "who").text == "carol (viewer, ops)"
    wait.until(lambda b: b.find_element(By.ID, "status").text.startswith("live"))
    # The session ends in the store (as when the ID token it lasts for expires); the browser keeps its cookie.
    cookie = browser.get_cookie("corral_session")
    assert cookie is not None
    ended = urllib.request.Request(
        cluster.url + "/console/signout",
        method="POST",
        headers={
            "Cookie": f"corral_session={cookie['value']}",
            "X-CSRF-Token": browser.execute_script("return state.me.csrf"),
        },
    )
    with urllib.request.urlopen(ended, timeout=10) as answer:
        assert answer.status == 200
    wait.until(lambda b: b.find_element(By.ID, "signin").is_displayed())
    assert "session ended" in browser.find_element(By.ID, "status").text
    assert not browser.find_element(By.ID, "login").is_displayed()  # the sign-in, not the admin key
    assert not browser.find_element(By.ID, "signout").is_displayed()
    assert browser.find_element(By.ID, "who").text == ""
    assert not browser.find_element(By.ID, "traffic-section").is_displayed()  # no stale figures

    # Signing out of a session that has ended already goes back to the console, the sign-in offered.
    browser.execute_script("window.beforeSignOut = true; document.getElementById('signout').click()")
    wait.until(lambda b: b.execute_script("return window.beforeSignOut") is None)  # a new page
    wait.until(lambda b: b.find_element(By.ID, "signin").is_displayed())
    assert [e for e in errors(browser) if "Uncaught" in e] == []


def test_a_viewers_key_in_the_admin_key_box_leaves_out_the_panels_the_gateway_refuses(
    cluster: RunningCluster,
    browser: webdriver.Chrome,  # noqa: F811  (the fixture imported above)
) -> None:
    """A key's role is the gateway's to tell (403): the keys and audit panels are left out and named, and
    the figures go on, poll after poll."""
    browser.get(cluster.url + "/console")
    browser.delete_all_cookies()
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    wait.until(lambda b: b.find_element(By.ID, "login").is_displayed())
    browser.find_element(By.ID, "key").send_keys(api_key(cluster, role="viewer"))
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait.until(lambda b: b.find_element(By.ID, "not-for-role").is_displayed())
    assert browser.find_element(By.ID, "not-for-role").text.endswith("API keys, audit trail")
    seen = {browser.find_element(By.ID, "status").text}
    for _ in range(3):  # "live · 12:00:01", then each poll's time: the polls go on
        wait.until(lambda b: b.find_element(By.ID, "status").text not in seen)
        seen.add(browser.find_element(By.ID, "status").text)
    assert all(text.startswith("live") for text in seen), seen
    assert not browser.find_element(By.ID, "login").is_displayed()
    assert not browser.find_element(By.ID, "keys-section").is_displayed()
    assert not browser.find_element(By.ID, "audit-section").is_displayed()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#replicas tbody tr")) == 2
    assert browser.find_element(By.ID, "tenants-section").is_displayed()  # its usage, without the keys
