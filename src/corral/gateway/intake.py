"""The pipeline's parse stage: a request's body validated and turned into its RequestContext: the model
(an adapter's requests routed over its base's replicas), what its engine does right, its size in tokens
(counted where the model names its tokenizer, else estimated), the context it may take, and the body sent
upstream. Used by the pipeline (pipeline.py) for requests, batch lines and the dialects' exchanges."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import orjson

from corral.admission import Principal, TokenCounter, TokenSizing
from corral.admission.tokens import LONG_TEXT_CHARS
from corral.engines import EngineFeatures
from corral.gateway.bodies import with_member
from corral.gateway.context import RequestContext
from corral.gateway.embeddings import upstream_body
from corral.gateway.failover import can_fail_over
from corral.gateway.fanout import check_features, needs_fanout
from corral.gateway.toolcalls import ToolEmulation, names_tools
from corral.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    InvalidRequest,
    ModelNotFound,
    RateLimited,
    parse_body,
)
from corral.routing import Router, RouteRequest
from corral.routing.adapters import Adapter, AdapterCatalogue

__all__ = ["Draft", "Intake", "prompt_text"]

_Kind = type[ChatCompletionRequest] | type[CompletionRequest]
_DEFAULT_OUTPUT_ESTIMATE = 256  # tokens, when a request sets no max_tokens


# a check of a request before its long prompt is counted (its context, the prompt not counted): when it
# comes (None) and at its counting turn (`AtTurn`)
BeforeCounting = Callable[[RequestContext, APIError | None], Awaitable[None]]


@dataclass(slots=True)
class Draft:
    """A generation request read and checked, its prompt not yet counted (`count`, in a thread where it
    is `long`)."""

    path: str
    body: ChatCompletionRequest | CompletionRequest
    raw: bytes  # as the engine reads it (a tool emulation's rewrite)
    upstream: bytes
    session: str | None
    adapter: Adapter | None
    base: str
    features: EngineFeatures
    emulation: ToolEmulation | None
    counter: TokenCounter | None
    tokens_per_byte: float
    prompt: str = ""  # the text the model's tokenizer counts (kept for routing); "" without one

    @property
    def long(self) -> bool:
        """Counting it takes a while (the model's tokenizer over a long prompt): off the event loop."""
        return self.counter is not None and len(self.prompt) >= LONG_TEXT_CHARS

    def count(self) -> int:
        """The prompt's tokens: counted where the model names its tokenizer, else estimated by size. Reads
        only the request and the tokenizer: safe in another thread."""
        if self.counter is None:
            return int(len(self.raw) * self.tokens_per_byte)
        return self.counter.count(self.prompt)


_ROOM_CHARS = 8 * 1024 * 1024  # a tenant's prompts at or waiting for its counting turn: their text, at most
_PACE = 1_000_000.0  # characters counted a second before any count was timed (tokens.py: 4 MB in 3.8 s)

# A long prompt's check (its key's limits) at its tenant's counting turn, the count following if it passes;
# given the refusal of it that `Counting` makes (too many of its tenant's prompts waiting), it records
# that and raises it.
AtTurn = Callable[[APIError | None], Awaitable[None]]


@dataclass(slots=True)
class _Turn:
    """A tenant's counting turn, and its prompts at or waiting for it (how many, their characters)."""

    lock: asyncio.Lock
    holders: int = 0
    chars: int = 0


class Counting:
    """Where long prompts are counted: two threads of their own (not the default pool, which key lookups
    and usage writes use), and one count at a time per tenant, so a tenant sending long prompts takes one
    core at most and never another tenant's turn. A count whose client left runs to its end and keeps its
    tenant's turn till then (a thread cannot be stopped).

    A tenant's prompts at or waiting for its turn hold at most `room` characters (or one prompt, however
    long), each counted as its body's bytes or its text's characters, whichever is more: each waiting
    one holds its body in memory, so past that a prompt is refused (429 `too_many_long_prompts`), its
    Retry-After the time the prompts before it take to count at the pace counts have gone (one that is
    refused at its turn takes less)."""

    def __init__(self, threads: int = 2, room: int = _ROOM_CHARS) -> None:
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="corral-count")
        self._turns: dict[str, _Turn] = {}
        self._room = room
        self._pace = _PACE  # characters counted a second, as the latest counts went

    async def run(
        self, tenant: str, count: Callable[[], int], chars: int, at_turn: AtTurn | None = None
    ) -> int:
        """`count()` (of a request holding `chars`: see above) in `tenant`'s turn, `at_turn` checked when the
        turn comes."""
        turn = self._turns.get(tenant)
        if turn is None:
            turn = self._turns[tenant] = _Turn(asyncio.Lock())
        if turn.chars and turn.chars + chars > self._room:
            refusal = self._crowded(turn.chars, turn.chars + chars - self._room)
            if at_turn is not None:
                await at_turn(refusal)  # (recorded, and raised)
            raise refusal
        turn.holders += 1
        turn.chars += chars
        try:
            await turn.lock.acquire()
        except BaseException:
            self._let_go(tenant, turn, chars, acquired=False)
            raise
        try:
            if at_turn is not None:
                await at_turn(None)
            counted = asyncio.get_running_loop().run_in_executor(self._threads, count)
        except BaseException:  # refused at its turn, the client gone, or the pool shut down (stopping)
            self._let_go(tenant, turn, chars, acquired=True)
            raise
        counted.add_done_callback(partial(self._counted, tenant, turn, chars, time.monotonic()))
        return await asyncio.shield(counted)

    def close(self) -> None:
        """Counts under way run to their end; none starts."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _crowded(self, waiting: int, over: int) -> RateLimited:
        return RateLimited(
            f"Too many long prompts of yours wait to be counted: {waiting:,} characters of them, and at most "
            f"{self._room:,} may wait at once. Send fewer at once, or retry after Retry-After.",
            code="too_many_long_prompts",
            retry_after=over / self._pace,
        )

    def _counted(
        self, tenant: str, turn: _Turn, chars: int, started: float, counted: asyncio.Future[int]
    ) -> None:
        if not counted.cancelled() and counted.exception() is None:  # (read: its caller may have left)
            took = time.monotonic() - started
            if took > 0:
                self._pace = 0.8 * self._pace + 0.2 * chars / took
        self._let_go(tenant, turn, chars, acquired=True)

    def _let_go(self, tenant: str, turn: _Turn, chars: int, acquired: bool) -> None:
        if acquired:
            turn.lock.release()
        turn.holders -= 1
        turn.chars -= chars
        if not turn.holders:
            del self._turns[tenant]


class Intake:
    """Makes each request's context (see the module's text); one per pipeline."""

    def __init__(
        self,
        router: Router,
        adapters: AdapterCatalogue,
        sizing: TokenSizing,
        failover_modes: dict[str, str],
    ) -> None:
        self._router = router
        self._replicas = router.replicas
        self._adapters = adapters
        self._sizing = sizing
        self._failover_modes = failover_modes  # a live apply adds new models' modes
        self._counting = Counting()

    def close(self) -> None:
        self._counting.close()

    async def generation(
        self,
        raw: bytes,
        path: str,
        kind: type[ChatCompletionRequest] | type[CompletionRequest],
        session: str | None,
        tenant: str | None,
        before_counting: BeforeCounting | None = None,
    ) -> RequestContext:
        """`tenant`'s request read, checked, counted (a long prompt by the model's tokenizer in a thread: a
        4 MB one takes seconds, which would stall every request on the event loop). `before_counting`
        may refuse a long prompt before its count, when it comes and again at its tenant's counting turn
        (the key's model list, budget and limits: pipeline.py)."""
        draft = self._draft(raw, kind, tenant, path, session)
        if not draft.long:
            return self._sized(draft, draft.count())
        check = None if before_counting is None else partial(before_counting, self._sized(draft, 0))
        if check is not None:
            await check(None)
        held = max(len(raw), len(draft.prompt))  # (what waiting holds: its body, or its text where longer)
        tokens = await self._counting.run(tenant or "", draft.count, held, check)
        return self._sized(draft, tokens)

    def _draft(
        self, raw: bytes, kind: _Kind, tenant: str | None, path: str = "", session: str | None = None
    ) -> Draft:
        """`tenant`'s request read and checked, its prompt not yet counted. An adapter kept for other
        tenants does not exist for `tenant` (before any other check, which would tell it apart from a name
        that does not exist)."""
        body = parse_body(kind, raw)
        _refuse_engine_names(body, session)
        adapter, base = self._resolve(body.model, tenant)
        features = self.features_of(base)
        if features.embeddings:
            raise InvalidRequest(
                f"The model '{body.model}' is an embedding model: it serves /v1/embeddings only.",
                param="model",
                code="model_not_supported",
            )
        check_features(body, features)
        emulation = None
        if not features.tools and isinstance(body, ChatCompletionRequest) and names_tools(body):
            try:  # tool calls its engine cannot make: asked for as JSON
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:  # (pydantic took NaN or Infinity; JSON has neither)
                raise InvalidRequest(f"The body is not strict JSON: {exc}.") from exc
            emulation = ToolEmulation(data)
            raw = emulation.request(data)
        upstream = _with_usage(raw) if body.stream and not body.include_usage else raw
        sizing = self._sizing
        counter = sizing.counters.get(base)
        return Draft(
            path, body, raw, upstream, session, adapter, base, features, emulation,
            counter, sizing.tokens_per_byte, prompt_text(body) if counter is not None else "",
        )  # fmt: skip

    def _sized(self, draft: Draft, input_tokens: int) -> RequestContext:
        """The request's context, its prompt `input_tokens` long (`draft.count()`)."""
        body, base, adapter = draft.body, draft.base, draft.adapter
        asked = (
            body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None
        ) or body.max_tokens
        max_tokens = asked or _DEFAULT_OUTPUT_ESTIMATE
        prompts = len(body.prompts) if isinstance(body, CompletionRequest) else 1
        each = -(-input_tokens // prompts)  # a prompt's share (`input_tokens` counts the whole list)
        self._check_context(body, base, asked, each if draft.counter is not None else None)
        route = RouteRequest(
            model=base,
            tokens=input_tokens + max_tokens * body.n * prompts,
            session=draft.session or body.user,
            prompt_tokens=input_tokens,
            sequences=body.n * prompts,
            adapter=adapter,
        )
        if getattr(self._router.policy_for(base), "needs_prompt", False):
            route.prompt = draft.prompt or prompt_text(body)
            if adapter is not None:  # engines share no KV blocks across adapters: neither does the index
                route.prompt = f"lora:{adapter.name}\n{route.prompt}"
            elif self._adapters.has_adapters(base):  # (a base prompt cannot pass for an adapter's)
                route.prompt = "lora:\n" + route.prompt
        context = self._replicas.context_length(base)
        may_generate = max(0, context - each) if asked is None and context else None
        return RequestContext(
            path=draft.path,
            body=body,
            upstream_body=draft.upstream,
            received_at=time.monotonic(),
            route=route,
            budget_tokens=input_tokens + may_generate * body.n * prompts if may_generate else None,
            features=draft.features,
            fanout=not body.stream and needs_fanout(body, draft.features),
            failover=(draft.emulation is None or not draft.emulation.active)  # (held JSON: not continued)
            and can_fail_over(
                body, self._failover_modes.get(base, "deterministic"), draft.features.continuation
            ),
            emulation=draft.emulation,
        )

    async def count_prompt(self, chat_body: bytes, principal: Principal) -> int:
        """What admission counts for a chat request's prompt (Anthropic's count_tokens)."""
        draft = self._draft(chat_body, ChatCompletionRequest, principal.tenant)
        principal.check_model(draft.body.model)
        if not draft.long:
            return draft.count()
        held = max(len(chat_body), len(draft.prompt))
        return await self._counting.run(principal.tenant, draft.count, held)

    def _resolve(self, model: str, tenant: str | None) -> tuple[Adapter | None, str]:
        """(the LoRA adapter `model` names, if any; the model whose replicas serve it). An adapter kept for
        other tenants does not exist for `tenant`: 404 before any other check of the request."""
        adapter = self._adapters.get(model)
        if adapter is None:
            return None, model
        if not adapter.allows(tenant):
            raise ModelNotFound(f"The model '{model}' does not exist on this server.", param="model")
        return adapter, adapter.base

    async def embedding(
        self, raw: bytes, path: str, tenant: str | None, before_counting: BeforeCounting | None = None
    ) -> RequestContext:
        """An embedding request: validated, for an embedding model, sized by its inputs' tokens (by the
        model's tokenizer in a thread where the body is long)."""
        body = parse_body(EmbeddingRequest, raw)
        features = self.features_of(body.model)
        if not features.embeddings:
            raise InvalidRequest(
                f"The model '{body.model}' does not make embeddings; ask one of the cluster's embedding "
                "models (task: embed).",
                param="model",
                code="model_not_supported",
            )
        counter = self._sizing.counters.get(body.model)
        count = partial(_input_tokens, body.inputs, counter, self._sizing.tokens_per_byte)
        chars = sum(len(i) for i in body.inputs if isinstance(i, str))
        if counter is None or chars < LONG_TEXT_CHARS:
            return _embedding_context(path, body, raw, features, count())
        check = None
        if before_counting is not None:
            check = partial(before_counting, _embedding_context(path, body, raw, features, 0))
            await check(None)
        tokens = await self._counting.run(tenant or "", count, max(len(raw), chars), check)
        return _embedding_context(path, body, raw, features, tokens)

    def features_of(self, model: str) -> EngineFeatures:
        if not self._replicas.has_model(model):
            raise ModelNotFound(f"The model '{model}' does not exist on this server.", param="model")
        return self._replicas.features(model)

    def _check_context(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        base: str,
        max_tokens: int | None,
        input_tokens: int | None,
    ) -> None:
        """Refuse output (and, where a tokenizer counts it exactly, prompt + output) beyond the context the
        model's replicas hold per sequence: the engine would hold a slot until the read timeout."""
        context = self._replicas.context_length(base)
        if context is None:
            return
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        if max_tokens is not None and max_tokens > context:
            raise InvalidRequest(
                f"{param} is too large: {max_tokens}. The model '{body.model}' holds at most {context} "
                "tokens per request (prompt and output together).",
                param=param,
                code="context_length_exceeded",
            )
        if input_tokens is not None and input_tokens + (max_tokens or 0) > context:
            raise InvalidRequest(
                f"This request needs {input_tokens + (max_tokens or 0)} tokens ({input_tokens} in the prompt"
                f"{f', {max_tokens} of output' if max_tokens else ''}), more than the {context} the model "
                f"'{body.model}' holds per request. Shorten the prompt or lower {param}.",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )


def _embedding_context(
    path: str, body: EmbeddingRequest, raw: bytes, features: EngineFeatures, tokens: int
) -> RequestContext:
    route = RouteRequest(
        model=body.model, tokens=tokens, session=body.user, prompt_tokens=tokens, sequences=len(body.inputs)
    )
    return RequestContext(
        path=path,
        body=body,
        upstream_body=upstream_body(raw),
        received_at=time.monotonic(),
        route=route,
        features=features,
    )


def _input_tokens(inputs: list[str | list[int]], counter: TokenCounter | None, per_byte: float) -> int:
    """An embedding request's tokens: token-id inputs by their length, texts by the model's tokenizer,
    else estimated by their size."""
    return sum(
        len(item)
        if isinstance(item, list)
        else counter.count(item)
        if counter is not None
        else max(1, int(len(item.encode()) * per_byte))
        for item in inputs
    )


# llama.cpp's own names for what OpenAI's fields say, which its server reads before them: passed through,
# `n_predict: -1` beside `max_tokens: 1` generated to the context while the gateway reserved one token
_ENGINE_NAMES = {"n_predict": "max_tokens", "n_cmpl": "n"}


def _refuse_engine_names(body: ChatCompletionRequest | CompletionRequest, session: str | None) -> None:
    extra = body.model_extra
    if extra:
        for name, instead in _ENGINE_NAMES.items():
            if name in extra:
                raise InvalidRequest(
                    f"'{name}' is llama.cpp's own name for what '{instead}' says: send '{instead}' (the "
                    "gateway reserves, checks and routes by it).",
                    param=name,
                    code="unsupported_parameter",
                )
    if session is not None and (len(session) > 256 or not session.isascii() or not session.isprintable()):
        raise InvalidRequest(
            "x-session-id must be at most 256 printable ASCII characters.", param="x-session-id"
        )


def prompt_text(body: ChatCompletionRequest | CompletionRequest) -> str:
    """The prompt as one string, for prefix-affinity routing and for counting: a chat's turns, their tool
    calls, and the tools it offers (the engine's template renders all of them into the prompt)."""
    if isinstance(body, ChatCompletionRequest):
        turns = "\n".join(
            f"{m.role}:{m.content}"
            + (
                _json_text(m.model_extra["tool_calls"])
                if m.model_extra and "tool_calls" in m.model_extra
                else ""
            )
            for m in body.messages
        )
        tools = (body.model_extra or {}).get("tools")
        return turns + _json_text(tools) if tools else turns
    return body.prompt if isinstance(body.prompt, str) else str(body.prompt)


def _json_text(value: object) -> str:
    try:
        return "\n" + orjson.dumps(value).decode()
    except TypeError:  # (nested past orjson's depth: counted by its text instead)
        return "\n" + str(value)


_ASK_USAGE = b',"stream_options":{"include_usage":true}'


def _with_usage(raw: bytes) -> bytes:
    """The body asking the engine for a usage chunk, which the relay strips again for the client (the
    member appended to the bytes as they are where the body names no `stream_options`)."""
    return with_member(raw, "stream_options", {"include_usage": True}, _ASK_USAGE, merge=True)
