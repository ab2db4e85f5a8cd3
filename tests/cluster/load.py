"""Continuous load through the official openai client, for tests that change a cluster while it serves.

Each user is a thread sending one request after another (streamed or not). What every request ended as is
kept: failures (any API error, or a stream that ended without a finish reason: truncated), the replica that
answered (the gateway's `x-corral-replica` header) and, for streams, the time to the first token.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import openai


@dataclass
class Answer:
    at: float  # when it ended (time.monotonic)
    replica: str
    ttft: float | None  # streams: seconds to the first content chunk


@dataclass
class Load:
    base_url: str
    model: str
    max_tokens: int = 8
    prompt: str = "Say hello."
    failures: list[str] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    _users: list[tuple[threading.Thread, threading.Event]] = field(default_factory=list)

    def add_users(self, streams: list[bool]) -> None:
        for stream in streams:
            stop = threading.Event()
            thread = threading.Thread(target=self._user, args=(stream, stop), daemon=True)
            self._users.append((thread, stop))
            thread.start()

    def remove_users(self, count: int) -> None:
        """Stop the newest `count` users (each finishes its request in flight)."""
        leaving, self._users = self._users[-count:], self._users[:-count]
        for _, stop in leaving:
            stop.set()
        for thread, _ in leaving:
            thread.join(timeout=120)

    def stop(self) -> None:
        self.remove_users(len(self._users))

    @property
    def served(self) -> int:
        return len(self.answers)

    def replicas_since(self, moment: float) -> set[str]:
        return {a.replica for a in self.answers if a.at >= moment}

    def ttft_p95_since(self, moment: float) -> float | None:
        ttfts = sorted(a.ttft for a in self.answers if a.at >= moment and a.ttft is not None)
        return ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None

    def _user(self, stream: bool, stop: threading.Event) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": self.prompt}]
        while not stop.is_set():
            started = time.monotonic()
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=self.model, messages=messages, max_tokens=self.max_tokens, stream=stream
                )
                replica = raw.headers.get("x-corral-replica", "")
                ttft = None
                if stream:
                    finished = False
                    for chunk in raw.parse():
                        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                            ttft = time.monotonic() - started
                        finished = finished or bool(chunk.choices and chunk.choices[0].finish_reason)
                    if not finished:
                        raise AssertionError("the stream ended without a finish reason (truncated)")
                else:
                    assert raw.parse().choices[0].finish_reason
                self.answers.append(Answer(time.monotonic(), replica, ttft))
            except (openai.APIError, AssertionError) as exc:
                self.failures.append(repr(exc))
