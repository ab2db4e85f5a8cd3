"""Making up for what an engine does not do right by itself (`EngineFeatures`), or refusing it cleanly.

- `n > 1`, and a list of prompts to /v1/completions, go to the engine as one single-choice request per
  choice, answered concurrently and merged into one answer: choices numbered as OpenAI numbers them (prompt
  i, choice j → i·n + j), usage summed (each prompt's tokens once, every choice's completion tokens). A seed
  becomes seed + j for choice j, so the choices differ and stay reproducible.
- `echo`: the gateway puts the prompt in front of each choice's text.
- What cannot be made up for is a 400 naming the field, never a silent ignore: image parts for an engine
  without images, streams that would need fanning out or an echo, echo with token-id prompts or logprobs.

The fanned-out requests share the queue slots their request was admitted with (one a part in flight, up to
the model's slots: `in_flight`); at most `MAX_PARTS` of them per request (a 400 beyond), 16 in flight at
once, and when one fails the others are cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web

from corral.engines import EngineFeatures
from corral.gateway.context import RequestContext
from corral.protocol import ChatCompletionRequest, CompletionRequest, InvalidRequest, UpstreamTimeout
from corral.protocol.usage import engine_usage
from corral.routing import RouteRequest

__all__ = ["Fanout", "check_features", "needs_fanout"]

_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_MEDIA_PARTS = frozenset({"image_url", "video_url", "audio_url"})  # (vLLM fetches their URLs)
MAX_PARTS = 128  # single-choice requests one request may fan out to (n × prompts)
_AT_ONCE = 16  # of them in flight at once


def in_flight(ctx: RequestContext) -> int:
    """The single-choice requests a fanned-out request has in flight at once, on any of its replicas."""
    return min(ctx.route.sequences, _AT_ONCE)


Forward = Callable[[RequestContext, web.Request | None], Awaitable[web.StreamResponse]]


def check_features(body: ChatCompletionRequest | CompletionRequest, features: EngineFeatures) -> None:
    """Refuse what the model's engine cannot answer and the gateway cannot make up for (InvalidRequest)."""
    if isinstance(body, ChatCompletionRequest):
        if not features.images:
            _refuse_images(body)
        elif not features.media_urls:
            _refuse_media_urls(body)
        if body.stream and body.n > 1 and not features.multiple_choices:
            raise _unavailable(body, "n", "streaming with n > 1", "send stream: false, or n: 1")
        return
    prompts = body.prompts
    if needs_fanout(body, features) and body.n * len(prompts) > MAX_PARTS:
        raise InvalidRequest(
            f"n × prompts is {body.n * len(prompts)}; the model '{body.model}' answers at most {MAX_PARTS} "
            "choices per request (its engine needs one request per choice).",
            param="n" if body.n > 1 else "prompt",
            code="too_many_choices",
        )
    if body.stream and len(prompts) > 1 and not features.prompt_lists:
        raise _unavailable(body, "prompt", "streaming a list of prompts", "send stream: false, or one prompt")
    if body.stream and body.n > 1 and not features.multiple_choices:
        raise _unavailable(body, "n", "streaming with n > 1", "send stream: false, or n: 1")
    if body.echo and not features.echo:
        if body.stream:
            raise _unavailable(body, "echo", "streaming with echo", "send stream: false")
        if not all(isinstance(p, str) for p in prompts):
            raise _unavailable(body, "echo", "echo of a token-id prompt", "send the prompt as text")
        if (body.model_extra or {}).get("logprobs"):
            raise _unavailable(body, "echo", "echo with logprobs (the prompt's own)", "drop logprobs")


def needs_fanout(body: ChatCompletionRequest | CompletionRequest, features: EngineFeatures) -> bool:
    if body.n > 1 and not features.multiple_choices:
        return True
    if isinstance(body, CompletionRequest):
        return (len(body.prompts) > 1 and not features.prompt_lists) or (body.echo and not features.echo)
    return False


class Fanout:
    """Answers one non-streaming request with several single-choice engine requests (see the module)."""

    def __init__(self, forward: Forward, replica_header: bool = True) -> None:
        self._forward = forward
        self._replica_header = replica_header

    async def answer(self, ctx: RequestContext, request: web.Request | None) -> web.StreamResponse:
        body, features = ctx.body, ctx.features
        try:
            data = orjson.loads(ctx.upstream_body)
        except orjson.JSONDecodeError as exc:  # (pydantic took NaN or Infinity; JSON has neither)
            raise InvalidRequest(f"The body is not strict JSON: {exc}.") from exc
        prompts: list[Any] = body.prompts if isinstance(body, CompletionRequest) else [None]
        gateway_echo = isinstance(body, CompletionRequest) and body.echo and not features.echo
        routed = _routing_prompts(ctx, prompts)
        parts = [
            replace(
                ctx,
                upstream_body=orjson.dumps(_single(data, prompt, j, gateway_echo)),
                route=_route(ctx, routed[i]),
                shares=len(prompts) * body.n,  # (one bound on the whole answers the request holds)
                # each its own engine request id (an engine may refuse one already running)
                request_id=f"{ctx.request_id}-{i * body.n + j}" if ctx.request_id else None,
            )
            for i, prompt in enumerate(prompts)
            for j in range(body.n)
        ]
        limit = asyncio.Semaphore(_AT_ONCE)

        async def forward(part: RequestContext) -> web.StreamResponse:
            async with limit:
                return await self._forward(part, request)

        tasks = [asyncio.ensure_future(forward(part)) for part in parts]
        try:
            responses = await asyncio.gather(*tasks)
        except BaseException as exc:  # one part failed (or the client left): the others stop too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # parts that reached an engine worked: a timeout, or a client that left, is charged at its
            # reservation (pipeline.py); any other failure (a 5xx, which keeps no reservation) at what the
            # parts answered before it came cost
            ctx.replica = next((part.replica for part in parts if part.replica is not None), None)
            if isinstance(exc, Exception) and not isinstance(exc, UpstreamTimeout):
                ctx.usage = _answered_usage(tasks, body.n, parts)
            raise
        answers = [_json(r) for r in responses]
        ctx.replica = parts[-1].replica
        ctx.usage = _usage(answers, body.n, [r.status for r in responses])
        failed = next((r for r in responses if r.status != 200), None)
        if failed is not None:
            return failed
        merged = answers[0]
        merged["choices"] = [
            _numbered(choice, k, prompts[k // body.n] if gateway_echo else None)
            for k, answer in enumerate(answers)
            for choice in answer.get("choices", [])[:1]
        ]
        if ctx.usage is not None:
            merged["usage"] = ctx.usage
        else:  # (the request is charged at its reservation: pipeline.py; no part's own counts are told)
            merged.pop("usage", None)
        served_by = ",".join(sorted({p.replica.id for p in parts if p.replica}))
        return web.Response(
            body=orjson.dumps(merged),
            content_type="application/json",
            headers={"x-corral-replica": served_by} if self._replica_header else {},
        )


def _single(data: dict[str, Any], prompt: Any, choice: int, gateway_echo: bool) -> dict[str, Any]:
    part = {**data, "n": 1}
    if prompt is not None:
        part["prompt"] = prompt
    if gateway_echo:
        part.pop("echo", None)
    if choice and isinstance(data.get("seed"), int):
        seed = data["seed"] + choice  # (past 2**64 - 1 it wraps: JSON's engines hold 64 bits)
        part["seed"] = seed - 2**64 if seed >= 2**64 else seed
    return part


def _routing_prompts(ctx: RequestContext, prompts: list[Any]) -> list[str]:
    """What routing reads of each prompt of a list: the request's routing prompt with the list's text (as
    intake writes it: the list's `str`) replaced by the prompt's own, after the same lines before it (the
    tenant's routing tag, the adapter's `lora:` line): as it reads a request of that prompt alone, so a part
    goes where that prompt's prefix is cached. Any other request's parts are routed by its whole prompt."""
    whole = ctx.route.prompt
    listed = ctx.body.prompt if isinstance(ctx.body, CompletionRequest) else None
    if not whole or not isinstance(listed, list) or isinstance(listed[0], int):  # not a list of prompts
        return [whole] * len(prompts)
    text = str(listed)
    if not whole.endswith(text):  # (not as intake writes it)
        return [whole] * len(prompts)
    head = whole[: len(whole) - len(text)]
    return [head + (prompt if isinstance(prompt, str) else str(prompt)) for prompt in prompts]


def _route(ctx: RequestContext, prompt: str | None = None) -> RouteRequest:
    """One part's routing request: `prompt` (None: the request's routing prompt), its share of the tokens."""
    prompts = len(ctx.body.prompts) if isinstance(ctx.body, CompletionRequest) else 1
    route = ctx.route
    prompt_tokens = route.prompt_tokens // prompts  # each part sends one prompt and asks one choice
    output = (route.tokens - route.prompt_tokens) // (ctx.body.n * prompts)
    return RouteRequest(
        route.model,
        tokens=prompt_tokens + output,
        tenant=route.tenant,  # (a part the engine answers with a 5xx is told as its tenant's, to the breaker)
        session=route.session,
        prompt=route.prompt if prompt is None else prompt,
        prompt_tokens=prompt_tokens,
        adapter=route.adapter,
    )


def _json(response: web.StreamResponse) -> dict[str, Any]:
    raw = response.body if isinstance(response, web.Response) else None
    try:
        data = orjson.loads(raw) if isinstance(raw, bytes) else {}
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def _usage(answers: list[dict[str, Any]], n: int, statuses: list[int]) -> dict[str, int] | None:
    """Each prompt's tokens once (its first choice's count), every choice's completion tokens; None where
    a part the engine answered has no usage that reads (a part refused, an error, counts none)."""
    counts: list[dict[str, Any]] = []
    for answer, status in zip(answers, statuses, strict=True):
        usage = engine_usage(answer.get("usage")) if status == 200 else {}
        if usage is None:
            return None
        counts.append(usage)
    prompt = sum(c.get("prompt_tokens", 0) for c in counts[::n])
    completion = sum(c.get("completion_tokens", 0) for c in counts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _answered_usage(
    tasks: Sequence[asyncio.Future[web.StreamResponse]], n: int, parts: Sequence[RequestContext]
) -> dict[str, int] | None:
    """The usage of the parts an engine answered (200) before the request failed, and of those that failed
    charged all the same (an answer too large to take: the relay sets its usage): each prompt's tokens
    once, every such choice's completion tokens; None where there is none."""
    prompt = completion = 0
    prompts: set[int] = set()
    for k, task in enumerate(tasks):
        if not task.done() or task.cancelled():
            continue
        if task.exception() is not None or task.result().status != 200:
            usage = parts[k].usage
        else:
            usage = engine_usage(_json(task.result()).get("usage"))
        if not usage:
            continue
        if k // n not in prompts:  # (part k asks prompt k // n's choice k % n)
            prompts.add(k // n)
            prompt += usage.get("prompt_tokens", 0)
        completion += usage.get("completion_tokens", 0)
    if not prompts:
        return None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _numbered(choice: dict[str, Any], index: int, echo: str | None) -> dict[str, Any]:
    choice = {**choice, "index": index}
    if echo is not None:
        choice["text"] = echo + (choice.get("text") or "")
    return choice


def _refuse_images(body: ChatCompletionRequest) -> None:
    for i, message in enumerate(body.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, dict) and (part.get("type") in _IMAGE_PARTS or "image_url" in part):
                raise InvalidRequest(  # (a part with no type is read by its key, as vLLM does)
                    f"The model '{body.model}' does not accept images: its engine runs without a vision "
                    "projector. Send text only, or use a model served with one.",
                    param=f"messages[{i}].content[{j}]",
                    code="unsupported_content",
                )


def _refuse_media_urls(body: ChatCompletionRequest) -> None:
    """A media part naming an http(s) URL (or any but a data: URL) is a 400 unless the model lets its
    engine fetch them (models[].media_urls): the engine fetches from inside the cluster's network, where a
    tenant could have it reach addresses no client can."""
    for i, message in enumerate(body.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            urls = _media_urls(part) if isinstance(part, dict) else ()
            if any(url[:5].lower() != "data:" for url in urls):
                raise InvalidRequest(
                    f"The model '{body.model}' takes media as data: URLs only (base64 in the request): its "
                    "engine does not fetch URLs for clients here (models[].media_urls).",
                    param=f"messages[{i}].content[{j}]",
                    code="unsupported_content",
                )


def _media_urls(part: dict[str, Any]) -> list[str]:
    """The URLs a chat content part names for its engine to load (an image, audio or a video): under every
    media key it holds, whatever its `type` says or without one (vLLM reads a part by a media key it
    holds); one that is no string reads as ""."""
    urls = []
    for key in _MEDIA_PARTS:
        if key in part:
            field = part[key]
            url = field.get("url") if isinstance(field, dict) else field
            urls.append(url if isinstance(url, str) else "")
    return urls


def _unavailable(
    body: ChatCompletionRequest | CompletionRequest, param: str, what: str, instead: str
) -> InvalidRequest:
    return InvalidRequest(
        f"{what[0].upper()}{what[1:]} is not available for the model '{body.model}': its engine does not "
        f"answer it correctly and the gateway cannot make up for it; {instead}.",
        param=param,
        code="unsupported_parameter",
    )
