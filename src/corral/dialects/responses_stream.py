"""The Responses API's answer, as items and as a stream of OpenAI's events (`response.created` …
`response.output_text.delta` … `response.completed`, numbered), from the engine's chat answer: the
encoder DialectStream feeds (dialects/chat.py), and the items both it and whole answers are made of."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from corral.dialects.chat import Answer, Encoder, ToolCall, whole_json

if TYPE_CHECKING:
    from corral.dialects.openai_responses import ResponsesExchange

__all__ = [
    "ResponsesEncoder",
    "call_item",
    "in_progress",
    "message_item",
    "reasoning_item",
    "usage_of",
]


class ResponsesEncoder(Encoder):
    """The Responses stream's events, in OpenAI's order, numbered."""

    def __init__(self, exchange: ResponsesExchange) -> None:
        self.exchange = exchange
        self.answer = Answer()
        self._seq = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the message or reasoning item being written
        self._calls: dict[str, dict[str, Any]] = {}  # call id → its item
        self._open_calls: dict[str, dict[str, Any]] = {}  # item id → a call whose arguments may still come
        self._may_be_whole: dict[str, dict[str, Any]] = {}  # the open calls whose last delta closed a bracket
        self._at: dict[str, int] = {}  # item id → its output index (calls by the thousand: no list search)
        self._failed: dict[str, Any] | None = None
        self._pieces: list[bytes] = []  # the open message's text so far, JSON-escaped
        self._text_event: bytes | None = None  # the open message's delta event, its number and text to fill
        self._head = b""  # the open reasoning item's fields in its delta events

    def _event(self, kind: bytes, fields: dict[str, Any]) -> bytes:
        """An event with its fields after its type and number (`fields`: never empty)."""
        return self._opening(kind) + b"," + orjson.dumps(fields)[1:] + b"\n\n"

    def _delta(self, kind: bytes, delta: str, head: bytes) -> bytes:
        """A delta event, written from bytes (one a token: the common case, kept cheap)."""
        return self._opening(kind) + head + b',"delta":' + orjson.dumps(delta) + b"}\n\n"

    def _opening(self, kind: bytes) -> bytes:
        """An event's first bytes, up to its sequence number (the next one)."""
        seq = self._seq
        self._seq += 1
        return b"event: " + kind + b'\ndata: {"type":"' + kind + b'","sequence_number":' + str(seq).encode()

    def _head_of(self, item: dict[str, Any], content: bool) -> bytes:
        index = len(self.output) - 1
        fields = f',"item_id":"{item["id"]}","output_index":{index}' + (
            ',"content_index":0' if content else ""
        )
        return fields.encode()

    def start(self) -> bytes:
        snapshot = self.exchange.snapshot
        out = b""
        for kind in (b"response.created", b"response.in_progress"):  # (the snapshot serialised once)
            out += (
                b"event: "
                + kind
                + b'\ndata: {"type":"'
                + kind
                + b'","sequence_number":'
                + str(self._seq).encode()
                + b',"response":'
                + snapshot
                + b"}\n\n"
            )
            self._seq += 1
        return out

    def _add(self, item: dict[str, Any]) -> bytes:
        out = self._close_settled()
        self._at[item["id"]] = len(self.output)
        self.output.append(item)
        if item["type"] == "function_call":
            self._open_calls[item["id"]] = item
        else:
            self._open = item
        return out + self._event(
            b"response.output_item.added", {"output_index": len(self.output) - 1, "item": in_progress(item)}
        )

    def text(self, delta: str) -> bytes:
        return self.text_escaped(orjson.dumps(delta)[1:-1])

    def text_escaped(self, escaped: bytes) -> bytes:
        template = self._text_event
        if template is None:  # the message's first text: its item and part open first
            return self._open_message(escaped)
        self._pieces.append(escaped)
        seq = self._seq
        self._seq = seq + 1
        return template % (seq, escaped)

    def _open_message(self, escaped: bytes) -> bytes:
        item = message_item(self.exchange.item_id("msg"), "", "in_progress")
        out = self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out += self._event(
            b"response.content_part.added",
            {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0, "part": part},
        )
        self._pieces = []
        kind = b"response.output_text.delta"
        head = self._head_of(item, content=True).replace(b"%", b"%%")
        self._text_event = (
            b"event: " + kind + b'\ndata: {"type":"' + kind + b'","sequence_number":%d'
            + head + b',"delta":"%s","logprobs":[]}\n\n'
        )  # fmt: skip
        return out + self.text_escaped(escaped)

    def _text(self) -> str:
        """The open message's text (its pieces were each checked as a JSON string's inside)."""
        return str(orjson.loads(b'"' + b"".join(self._pieces) + b'"'))

    def reasoning(self, delta: str) -> bytes:
        out = b""
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = reasoning_item(self.exchange.item_id("rs"), "", "in_progress")
            out += self._add(item)
            self._head = self._head_of(item, content=True)
        item["content"][0]["text"] += delta
        return out + self._delta(b"response.reasoning_text.delta", delta, head=self._head)

    def tool_call(self, call: ToolCall) -> bytes:
        item = call_item(self.exchange.item_id("fc"), call, "in_progress")
        self._calls[call.id] = item
        return self._add(item)

    def tool_arguments(self, call: ToolCall, delta: str) -> bytes:
        item = self._calls[call.id]
        if item["status"] != "in_progress":  # closed whole: what follows (white space) would not parse
            return b""
        item["arguments"] += delta
        if delta.rstrip().endswith(("}", "]")):
            self._may_be_whole[item["id"]] = item
        elif delta.strip():  # (white space after a closing bracket leaves them as whole as they were)
            self._may_be_whole.pop(item["id"], None)
        head = f',"item_id":"{item["id"]}","output_index":{self._at[item["id"]]}'.encode()
        return self._delta(b"response.function_call_arguments.delta", delta, head=head)

    def _close_settled(self) -> bytes:
        """Before a new item: the open message or reasoning item's closing events, and those of each open
        call whose arguments are whole. An engine may stream parallel calls side by side (their deltas
        interleaved; each event names its item): a call whose arguments are not whole yet stays open, its
        later deltas still between its added and done events, and is closed at the end."""
        out = self._close()
        if self._may_be_whole:  # (only calls whose arguments changed are read: thousands stay linear)
            for item in self._may_be_whole.values():
                if whole_json(item["arguments"]):
                    del self._open_calls[item["id"]]
                    out += self._close_item(item)
            self._may_be_whole.clear()
        return out

    def _close(self) -> bytes:
        """The open message or reasoning item's closing events."""
        item, self._open = self._open, None
        self._text_event = None
        if item is None:
            return b""
        return self._close_item(item)

    def _close_item(self, item: dict[str, Any]) -> bytes:
        index = self._at[item["id"]]
        item["status"] = self._ended(item)
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            part["text"] = self._text()
            out += self._event(
                b"response.output_text.done",
                {
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
            )
            out += self._event(
                b"response.content_part.done",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            )
        elif item["type"] == "reasoning":
            out += self._event(
                b"response.reasoning_text.done",
                {
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": item["content"][0]["text"],
                },
            )
        elif item["type"] == "function_call":
            out += self._event(
                b"response.function_call_arguments.done",
                {
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                },
            )
        return out + self._event(b"response.output_item.done", {"output_index": index, "item": item})

    def _close_all(self) -> bytes:
        out = self._close()
        for item in self._open_calls.values():  # (in their order)
            out += self._close_item(item)
        self._open_calls.clear()
        self._may_be_whole.clear()
        return out

    def closing_response(self) -> dict[str, Any]:
        """The response as it ends (for the store, before its last events are written); a cut one as its
        `response.failed` event tells it: what came, the items it cut short `incomplete`."""
        if self._open is not None and self._open["type"] == "message":
            self._open["content"][0]["text"] = self._text()
        if self._failed is not None:
            output = [
                item if item["status"] == "completed" else dict(item, status="incomplete")
                for item in self.output
            ]
            return self.exchange.response("failed", output, self.answer.usage, error=self._failed)
        output = [dict(item, status=self._ended(item)) for item in self.output]
        return self.exchange.finished(self.answer, output)

    def _ended(self, item: dict[str, Any]) -> str:
        """An item's status once the answer ends well: a call cut by max_output_tokens (its arguments not
        whole JSON: side by side calls may each be) is incomplete (a next turn does not carry it on), as a
        whole answer's is."""
        cut = self.answer.finish_reason == "length" and item["type"] == "function_call"
        return "incomplete" if cut and not whole_json(item["arguments"]) else "completed"

    def finish(self) -> bytes:
        out = self._close_all()
        final = self.exchange.final or self.closing_response()
        kind = b"response.incomplete" if final["status"] == "incomplete" else b"response.completed"
        return out + self._event(kind, {"response": final})

    def error(self, message: str, code: str | None) -> bytes:
        out = self._event(b"error", {"code": code or "server_error", "message": message, "param": None})
        self._failed = {"code": "server_error", "message": message}
        return out + self._event(b"response.failed", {"response": self.closing_response()})


def in_progress(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is announced: no text, no arguments yet."""
    if item["type"] == "message":
        return {**item, "content": []}
    if item["type"] == "reasoning":
        return {**item, "content": []}
    return {**item, "arguments": ""}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }


def usage_of(usage: dict[str, Any]) -> dict[str, Any]:
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": prompt + completion,
    }
