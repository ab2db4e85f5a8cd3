"""What routing is told about each single-choice part of a request the gateway fans out."""

from __future__ import annotations

from corral.gateway.context import RequestContext
from corral.gateway.fanout import _route
from corral.protocol import ChatCompletionRequest, CompletionRequest
from corral.routing import RouteRequest


def _context(body: ChatCompletionRequest | CompletionRequest, route: RouteRequest) -> RequestContext:
    return RequestContext(path="/v1/x", body=body, upstream_body=b"", received_at=0.0, route=route)


def test_each_choice_of_n_is_routed_with_the_whole_prompt_and_its_share_of_the_output() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "n": 4, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    )
    route = RouteRequest("m", tokens=1000 + 4 * 50, prompt_tokens=1000, prompt="p", tenant="acme")
    part = _route(_context(body, route))
    assert (part.prompt_tokens, part.tokens, part.prompt) == (1000, 1050, "p")
    assert part.tenant == "acme"  # (a 5xx to a part is its tenant's input's, as a whole request's would be)


def test_each_prompt_of_a_list_is_routed_with_its_share_of_the_prompt_tokens() -> None:
    body = CompletionRequest.model_validate({"model": "m", "max_tokens": 10, "prompt": ["a b", "c d"]})
    part = _route(_context(body, RouteRequest("m", tokens=600 + 2 * 10, prompt_tokens=600)))
    assert (part.prompt_tokens, part.tokens) == (300, 310)
