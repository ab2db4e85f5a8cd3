"""Bad input gets the right status and an OpenAI-shaped error naming the problem; never a 500."""

from __future__ import annotations

import aiohttp
import pytest

from .conftest import Gateway, ScriptedUpstream


async def post(gw: Gateway, path: str, data: bytes | str, **headers: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            gw.base_url + path, data=data, headers={"Content-Type": "application/json", **headers}
        ) as resp:
            return resp.status, await resp.json()


def assert_openai_error(body: dict) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ('{"model": "m", "messages": [', None, "not valid JSON"),
        ("[1, 2]", None, "JSON object"),
        ("", None, "empty"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "model", "required"),
        ('{"model": "m", "messages": "hello"}', "messages", "array"),
        ('{"model": "m", "messages": []}', "messages", "at least 1"),
        ('{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role", "'user'"),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}',
            "max_tokens",
            "greater than or equal to 1",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
            "max_tokens",
            "integer",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9}',
            "temperature",
            "2",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}',
            "n",
            "greater than or equal to 1",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "stream",
            "boolean",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}',
            None,
            "stream",
        ),
    ],
)
async def test_invalid_body_is_400_naming_the_field(
    gateway: Gateway, upstream: ScriptedUpstream, body: str, param: str | None, words: str
) -> None:
    gateway.add_replica(upstream.url)
    status, reply = await post(gateway, "/chat/completions", body)
    assert status == 400
    error = assert_openai_error(reply)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]
    assert upstream.bodies == []


async def test_completions_prompt_is_validated(gateway: Gateway, upstream: ScriptedUpstream) -> None:
    gateway.add_replica(upstream.url)
    status, reply = await post(gateway, "/completions", '{"model": "m", "prompt": 42}')
    assert status == 400
    assert assert_openai_error(reply)["param"] == "prompt"


async def test_unknown_model_is_404(gateway: Gateway, upstream: ScriptedUpstream) -> None:
    gateway.add_replica(upstream.url)
    status, reply = await post(
        gateway, "/chat/completions", '{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}'
    )
    assert status == 404
    error = assert_openai_error(reply)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


async def test_body_over_the_limit_is_413(gateway: Gateway, upstream: ScriptedUpstream) -> None:
    gateway.add_replica(upstream.url)
    huge = '{"model": "m", "messages": [{"role": "user", "content": "' + "x" * 200_000 + '"}]}'
    status, reply = await post(gateway, "/chat/completions", huge)
    assert status == 413
    assert assert_openai_error(reply)["code"] == "request_too_large"
    assert upstream.bodies == []


async def test_unknown_path_and_wrong_method_are_openai_errors(gateway: Gateway) -> None:
    status, reply = await post(gateway, "/nothing/here", "{}")
    assert status == 404 and assert_openai_error(reply)["code"] == "not_found"
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway.base_url + "/chat/completions") as resp:
            assert resp.status == 405
            assert assert_openai_error(await resp.json())["code"] == "method_not_allowed"


async def test_unknown_fields_pass_through_to_the_engine(
    gateway: Gateway, upstream: ScriptedUpstream
) -> None:
    gateway.add_replica(upstream.url)
    status, _ = await post(
        gateway,
        "/chat/completions",
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": 5}',
    )
    assert status == 200
    assert upstream.bodies[-1]["top_k"] == 5
