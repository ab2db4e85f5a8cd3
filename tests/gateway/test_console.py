"""The web console in a real headless Chromium (Debian's chromium and chromium-driver, via Selenium): it
loads without console errors (its content security policy refusing nothing it uses), its numbers move
while load runs, no other page may frame it, a closed gateway's console asks for the admin key, and a
screenshot is kept as a test artifact (`$CORRAL_TEST_ARTIFACTS`, else the test's tmp)."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import RunningCluster, cluster_of

pytestmark = pytest.mark.slow  # real engines or servers, or long drills (`make test-fast` skips)

SPEC = """
supervisor: {{probe_interval: 0.5}}
auth: {auth}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {{engine: sim, replicas: 2, gpu: h100-sxm, time_scale: 20}}
"""
ADMIN = "console-admin-key"


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "scripts/test-services.sh installs Debian's chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1100",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("CORRAL_TEST_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load(cluster: RunningCluster, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        client = openai.OpenAI(base_url=cluster.base_url, api_key=ADMIN)
        while not stop.is_set():
            for _ in client.chat.completions.create(
                model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=32, stream=True
            ):
                pass

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def number(browser: webdriver.Chrome, element: str) -> float | None:
    text = browser.find_element(By.ID, element).text
    try:
        return float(text)
    except ValueError:
        return None


def errors(browser: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def watch_policy_violations(browser: webdriver.Chrome) -> None:
    """Every page the browser opens from now on lists what its content security policy refused (a script,
    style, image or request the console needs but its policy forbids) in `window.refusedByPolicy`."""
    browser.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument",
        {
            "source": "window.refusedByPolicy = []; document.addEventListener('securitypolicyviolation',"
            " (e) => window.refusedByPolicy.push(e.effectiveDirective + ' ' + e.blockedURI));"
        },
    )


def test_console_shows_live_numbers_without_errors(tmp_path: Path, browser: webdriver.Chrome) -> None:
    watch_policy_violations(browser)
    with cluster_of(tmp_path, SPEC.format(auth="{open: true}")) as cluster:
        browser.get(cluster.url + "/console")
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#replicas tbody tr td.ready")) == 2)
        stop = threading.Event()
        users = [load(cluster, stop) for _ in range(3)]
        try:
            wait.until(lambda b: (number(b, "rps") or 0) > 0)
            wait.until(lambda b: (number(b, "tps") or 0) > 0)
            first = browser.find_element(By.ID, "rps").text
            wait.until(lambda b: b.find_element(By.ID, "rps").text != first)  # it keeps moving
            wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#decisions tbody tr")) > 0)
            assert "/" in browser.find_element(By.ID, "ttft").text
            assert len(browser.find_elements(By.CSS_SELECTOR, "canvas")) >= 4  # the four charts
            browser.save_screenshot(str(artifacts(tmp_path) / "console.png"))
        finally:
            stop.set()
            for thread in users:
                thread.join(timeout=30)
        url = cluster.url + "/admin/replicas/llama-8b-1/drain?grace=10"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as response:
            assert response.status == 200

        def listed(b: webdriver.Chrome) -> bool:  # the Changes panel lists the drain
            rows = b.find_elements(By.CSS_SELECTOR, "#events tr")
            return any("llama-8b-1 drained" in row.text for row in rows)

        wait.until(listed)
        assert browser.find_element(By.ID, "rollouts").text == "no rollout has run"
        assert errors(browser) == []
        assert browser.execute_script("return window.refusedByPolicy") == []  # all it uses, its policy allows


def test_no_other_page_may_frame_the_console(tmp_path: Path, browser: webdriver.Chrome) -> None:
    """On an open gateway a page of another origin that framed the console would act as a local admin (one
    click on "revoke" acts): the page and its files say no page may frame them, and Chromium obeys."""
    with cluster_of(tmp_path, SPEC.format(auth="{open: true}")) as cluster:
        for name in ("", "/console.js", "/console.css", "/vendor/uPlot.iife.min.js", "/vendor/uPlot.min.css"):
            with urllib.request.urlopen(cluster.url + "/console" + name, timeout=10) as answer:
                assert answer.headers["X-Frame-Options"] == "DENY", name
                policy = answer.headers["Content-Security-Policy"]
                assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy, name
        page = f'<link rel="icon" href="data:,"><iframe id="framed" src="{cluster.url}/console"></iframe>'
        (tmp_path / "framing.html").write_text(page)
        files = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
        other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), files)  # another origin: localhost:PORT
        serving = threading.Thread(target=other.serve_forever)
        serving.start()
        try:
            browser.get(f"http://localhost:{other.server_port}/framing.html")
            browser.switch_to.frame(browser.find_element(By.ID, "framed"))
            WebDriverWait(browser, 30, poll_frequency=0.2).until(
                lambda b: b.execute_script("return location.href") != "about:blank"
            )
            assert browser.find_elements(By.ID, "status") == []  # Chromium showed its error page instead
        finally:
            browser.switch_to.default_content()
            other.shutdown()
            serving.join(timeout=10)
            other.server_close()
        assert any("frame-ancestors 'none'" in e for e in errors(browser))


def test_closed_gateway_console_asks_for_the_admin_key(tmp_path: Path, browser: webdriver.Chrome) -> None:
    spec = SPEC.format(auth=f"{{open: false, admin_key: {ADMIN}}}")
    with cluster_of(tmp_path, spec, admin_key=ADMIN) as cluster:
        # a tenant with a budget that used some of it: the Tenants table says how much
        made = urllib.request.Request(
            cluster.url + "/admin/keys",
            data=json.dumps({"tenant": "acme", "monthly_token_budget": 100000}).encode(),
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
        )
        secret = json.load(urllib.request.urlopen(made, timeout=10))["key"]
        openai.OpenAI(base_url=cluster.base_url, api_key=secret).chat.completions.create(
            model="llama-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        deadline = time.monotonic() + 10
        while not _month_tokens(cluster.url) and time.monotonic() < deadline:  # (usage written every second)
            time.sleep(0.2)
        browser.execute_cdp_cmd("Network.clearBrowserCache", {})
        browser.get(cluster.url + "/console")
        browser.execute_script("sessionStorage.clear()")
        browser.refresh()
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda b: b.find_element(By.ID, "login").is_displayed())
        assert browser.find_elements(By.CSS_SELECTOR, "#replicas tbody tr") == []  # nothing without the key
        browser.find_element(By.ID, "key").send_keys(ADMIN)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#replicas tbody tr td.ready")) == 2)
        assert not browser.find_element(By.ID, "login").is_displayed()
        wait.until(lambda b: "acme" in b.find_element(By.ID, "tenants").text)
        row = next(r for r in browser.find_elements(By.CSS_SELECTOR, "#tenants tbody tr") if "acme" in r.text)
        assert re.search(r"\d[\d,]* / 100,000 \(\d+%\)", row.text), row.text  # budget used this month
        # The refused polls before the key was given are the only errors the page met.
        seen = [e for e in errors(browser) if cluster.url in e]  # (not the previous test's page, stopped)
        assert all("401" in e or "403" in e for e in seen), seen


def _month_tokens(url: str) -> int:
    request = urllib.request.Request(url + "/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"})
    keys = json.load(urllib.request.urlopen(request, timeout=10))["keys"]
    return sum(k["month_tokens"] for k in keys)
