"""Browsers' cross-origin calls (`gateway.cors_origins`): a web page of a listed origin calls the client
APIs with its key in a header, in a real Chromium; other origins, the admin API and a gateway without the
setting are refused by the browser. The preflight and answer headers are checked in process too."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from selenium import webdriver

from corral.cluster import free_port
from corral.config import GatewaySettings, SpecError, parse_spec
from corral.gateway import GatewayServer
from corral.routing import ReplicaSet, Router
from tests.conftest import RunningCluster, cluster_of
from tests.gateway.test_console import browser  # noqa: F401  (the Chromium fixture)

from .conftest import Gateway, ScriptedUpstream, make_services

PAGE = "https://chat.example.com"
ASKED = {"Origin": PAGE, "Access-Control-Request-Method": "POST"}


@pytest.fixture
async def cors_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    replicas = ReplicaSet(["m"])
    settings = GatewaySettings(port=0, cors_origins=[PAGE])
    server = GatewayServer(settings, Router(replicas), make_services(replicas, tmp_path / "corral.db"))
    await server.start()
    yield Gateway(f"http://127.0.0.1:{server.port}", replicas, server)
    await server.stop()


async def test_a_listed_origin_is_answered_and_others_are_not(
    cors_gateway: Gateway, gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    cors_gateway.add_replica(upstream.url)
    url = cors_gateway.url
    asked = {**ASKED, "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    async with aiohttp.ClientSession() as session:
        async with session.options(url + "/v1/chat/completions", headers=asked) as preflight:
            assert preflight.status == 200
            allowed = preflight.headers
            assert allowed["Access-Control-Allow-Origin"] == PAGE
            assert "POST" in allowed["Access-Control-Allow-Methods"]
            assert set(allowed["Access-Control-Allow-Headers"].lower().split(",")) >= {
                "authorization",
                "content-type",
                "x-stainless-os",
            }
            assert allowed["Access-Control-Max-Age"] == "600"
            assert "Access-Control-Allow-Credentials" not in allowed  # keys travel in a header
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with session.post(url + "/v1/chat/completions", json=body, headers={"Origin": PAGE}) as answer:
            assert answer.status == 200 and await answer.read()
            assert answer.headers["Access-Control-Allow-Origin"] == PAGE
            exposed = answer.headers["Access-Control-Expose-Headers"].lower()
            assert "x-request-id" in exposed
        stranger = {**ASKED, "Origin": "https://evil.example"}
        async with session.options(url + "/v1/chat/completions", headers=stranger) as refused:
            assert refused.status == 403 and "Access-Control-Allow-Origin" not in refused.headers
        async with session.post(
            url + "/v1/chat/completions", json=body, headers={"Origin": "https://evil.example"}
        ) as unread:  # served (a browser sends it), but no page of that origin may read it
            assert "Access-Control-Allow-Origin" not in unread.headers
            await unread.read()
        async with session.options(
            url + "/admin/keys", headers={**ASKED, "Access-Control-Request-Method": "GET"}
        ) as admin:
            assert admin.status == 405 and "Access-Control-Allow-Origin" not in admin.headers
        async with session.options(gateway.url + "/v1/chat/completions", headers=asked) as unset:
            assert unset.status == 405 and "Access-Control-Allow-Origin" not in unset.headers


def test_an_origin_is_a_scheme_and_host_only() -> None:
    model = "models:\n  - {name: m, deployments: [{engine: external, urls: ['http://127.0.0.1:1']}]}\n"
    given = "['*', 'http://localhost:3000', 'https://Chat.Example.com:443', 'http://[::1]:8080']"
    spec = parse_spec(f"gateway: {{cors_origins: {given}}}\n" + model)
    assert spec.gateway.cors_origins == [
        "*",
        "http://localhost:3000",
        "https://chat.example.com",
        "http://[::1]:8080",
    ]
    for bad in ("https://chat.example.com/", 'https://a"b.com', "https://a;b", "chat.example.com"):
        with pytest.raises(SpecError, match="is not an origin"):
            parse_spec(f"gateway: {{cors_origins: ['{bad}']}}\n" + model)


SPEC = """
supervisor: {{probe_interval: 0.5}}
auth: {{open: true}}
gateway: {{cors_origins: ['{origin}']}}
models:
  - name: llama-8b
    arch: llama-3.1-8b
    deployments:
      - {{engine: sim, replicas: 1, gpu: h100-sxm, time_scale: 20}}
"""

FETCH = """
const [url, path, method, done] = arguments;
const init = {method, headers: {"Authorization": "Bearer none", "Content-Type": "application/json"}};
if (method === "POST") init.body = JSON.stringify({model: "llama-8b", max_tokens: 4,
    messages: [{role: "user", content: "hi"}]});
fetch(url + path, init)
  .then(async r => done({status: r.status, id: r.headers.get("x-request-id"), text: await r.text()}))
  .catch(e => done({error: String(e)}));
"""


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two page origins on this machine (an empty page each): the first is listed, the second is not."""
    folder = tmp_path_factory.mktemp("pages")
    (folder / "index.html").write_text("<!doctype html><title>a page</title>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tuple(f"http://127.0.0.1:{s.server_address[1]}" for s in servers)  # type: ignore[misc]
    for server in servers:
        server.shutdown()


@pytest.mark.slow
def test_a_web_page_of_a_listed_origin_calls_the_gateway_in_a_real_browser(
    browser: webdriver.Chrome,  # noqa: F811  (the fixture imported above)
    pages: tuple[str, str],
    tmp_path: Path,
) -> None:
    listed, other = pages
    with cluster_of(tmp_path, SPEC.format(origin=listed)) as cluster:
        browser.get(listed + "/index.html")
        answer = fetch(browser, cluster, "/v1/chat/completions", "POST")
        assert answer.get("status") == 200 and '"choices"' in answer["text"], answer
        assert answer["id"] and answer["id"].startswith("req_")  # an exposed header: readable by the page
        assert fetch(browser, cluster, "/v1/models", "GET").get("status") == 200
        assert "error" in fetch(browser, cluster, "/admin/keys", "GET")  # same-origin only
        browser.get(other + "/index.html")
        refused = fetch(browser, cluster, "/v1/chat/completions", "POST")
        assert refused == {"error": "TypeError: Failed to fetch"}, refused


def fetch(chrome: webdriver.Chrome, cluster: RunningCluster, path: str, method: str) -> dict[str, str]:
    chrome.set_script_timeout(30)
    return dict(chrome.execute_async_script(FETCH, cluster.url, path, method))
