"""A relay over the real router, placement and loader, to vLLM engines a test fakes (their `post`): what
the adapter tests (tests/lora, tests/routing) share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from corral.gateway.relay import Relay, RelayTimeouts
from corral.routing import Replica, ReplicaSet, Router
from corral.routing.adapters import AdapterCatalogue, AdapterPlacement


@dataclass
class EngineAnswer:
    """An engine's answer, as the relay reads one (EngineResponse's part it uses)."""

    status: int
    body: bytes
    content_type: str = "application/json"
    retry_after: bytes = b""

    async def read(self, limit: int | None = None) -> bytes:
        return self.body

    def release(self) -> None:
        pass


def relay_over(
    replicas: list[Replica],
    engines: object,
    catalogue: AdapterCatalogue,
    clock: Callable[[], float] | None = None,
) -> tuple[Router, Relay]:
    """A relay to `engines` (anything with EngineClient's `post`) for model m's `replicas`, routing by
    least outstanding requests, with placement on `clock` where given."""
    replica_set = ReplicaSet(["m"])
    for replica in replicas:
        replica_set.add(replica)
    router = Router(replica_set, default_policy="least_outstanding_requests")
    if clock is not None:
        router.adapters = AdapterPlacement(clock=clock)
    timeouts = RelayTimeouts(connect=1.0, read=1.0)
    # (the session only tokenizes a failed-over stream's text: none here)
    return router, Relay(cast(Any, engines), cast(Any, None), router, 1, timeouts, adapters=catalogue)
