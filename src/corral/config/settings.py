"""The cluster-wide sections: gateway, supervisor, store, limits, queue, Ray, deploy."""

from __future__ import annotations

import ipaddress
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from corral.config.base import Strict
from corral.config.models import RoutingPolicyName


class TLSSettings(Strict):
    """A certificate chain and its private key, PEM files (`corral deploy certs` makes development ones)."""

    cert: Path = Field(description="PEM certificate chain: the server certificate first")
    key: Path = Field(description="PEM private key of the certificate")
    check_interval: Annotated[float, Field(gt=0, le=86400)] = Field(
        default=60.0,
        description="seconds between looks at cert and key for a renewal: a changed pair that works is "
        "used for new connections, without a restart (one that does not is logged; the old stays)",
    )


class GatewaySettings(Strict):
    """The gateway's listener, limits and upstream timeouts (seconds)."""

    host: str = Field(default="127.0.0.1", description="address the gateway listens on")
    port: Annotated[int, Field(ge=0, le=65535, description="port the gateway listens on (0: any free)")] = (
        8000
    )
    max_body_bytes: Annotated[int, Field(ge=1024, description="largest request body, bytes (413 above)")] = (
        4 * 1024 * 1024
    )
    connect_timeout: Annotated[float, Field(gt=0, description="seconds to connect to a replica")] = 3.0
    read_timeout: Annotated[
        float, Field(gt=0, description="seconds a replica may stay silent before 504")
    ] = 120.0
    retries: Annotated[
        int, Field(ge=0, le=5, description="retries on another replica before the first byte")
    ] = 1
    routing: RoutingPolicyName = Field(
        default="prefix_affinity", description="routing policy for models that name none"
    )
    stall_timeout: Annotated[
        float,
        Field(gt=0, description="seconds a replica may go silent mid-stream before the stream fails over"),
    ] = 15.0
    body_timeout: Annotated[
        float, Field(gt=0, description="seconds a client may take to send its request body before 408")
    ] = 30.0
    send_timeout: Annotated[
        float,
        Field(
            gt=0,
            description="seconds a client may take not one byte of an answer its connection's buffer holds "
            "before the gateway closes the connection: a stream then counts as a client that left (499) "
            "and its replica slot is freed (NGINX's send_timeout)",
        ),
    ] = 60.0
    idle_timeout: Annotated[
        float,
        Field(
            gt=0,
            description="seconds a client connection may stay open without sending a whole request (a new "
            "one, or half a header) or between its requests; above the rendered NGINX edge's upstream "
            "keepalive_timeout (60 s), so the edge never reuses a connection the gateway closed",
        ),
    ] = 75.0
    max_header_bytes: Annotated[
        int,
        Field(ge=1024, description="longest request line or header field, bytes (a longer one: 400)"),
    ] = 8190
    max_client_connections: Annotated[
        int,
        Field(
            ge=1,
            description="open connections one client address may hold (per gateway process); one more is "
            "closed at once. Peers in trusted_proxies (the edge, which multiplexes many clients) are "
            "exempt: the edge's own per-address limit applies there",
        ),
    ] = 256
    max_upstream_connections: Annotated[
        int, Field(ge=1, description="open connections to replicas at most; more requests wait for one")
    ] = 4096
    shutdown_grace: Annotated[
        float, Field(ge=0, description="seconds in-flight requests may finish after Ctrl-C/SIGTERM")
    ] = 10.0
    prefill_coalescing: bool = Field(
        default=False,
        description="hold a request whose long prefix a replica is computing right now for another request "
        "until that prefill ends, so the engine computes it once (saves fleet compute on same-document "
        "bursts; costs TTFT when replicas have spare capacity)",
    )
    tls: TLSSettings | None = Field(
        default=None, description="serve HTTPS itself (a single box without an NGINX edge): cert and key"
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (CIDR) of proxies whose X-Forwarded-For names the client, e.g. "
        "[127.0.0.1] behind an NGINX edge on this host; from any other peer the header is ignored",
    )
    routing_headers: bool | None = Field(
        default=None,
        description="answers carry x-corral-replica (which replica served them); unset: on an open "
        "gateway only (on a closed one the replica a tenant's prompt went to tells of other tenants' "
        "prompts)",
    )
    metrics_token: str | None = Field(
        default=None,
        repr=False,
        description="on a closed gateway, /metrics answers only this bearer token (a scraper's: `corral "
        "observe render` writes it for Prometheus) or the admin key; an open gateway serves it to anyone",
    )
    metrics_tenant_labels: bool = Field(
        default=True,
        description="label /metrics series by tenant and key (corral_tenant_*, budget use, cache lookups); "
        'false counts every tenant under one tenant "-" and leaves out the per-key budget series',
    )
    access_log: bool = Field(
        default=False,
        description="log one line per request: client address (through trusted proxies), method, path, "
        "status, bytes, seconds, request id (x-request-id)",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="origins whose web pages may call the client APIs (/v1/) from a browser, e.g. "
        "https://chat.example.com, or * for any; none: browsers refuse those calls (keys travel in a "
        "header, so no cookies are involved; the admin API and console stay same-origin)",
    )
    workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        default="auto",
        description="gateway processes sharing the port (SO_REUSEPORT) and one supervisor's replica set; "
        "more than 1 needs limits.backend: redis (and cache.backend: redis where models cache). auto: one "
        "per CPU this process may use (a container's CPU limit, not the host's cores) when limits (and any "
        "cache) are in Redis and the gateway listens beyond loopback (a "
        "server), else 1; never more than a replica's slots (parallel / max_num_seqs): each worker holds "
        "a share of them",
    )

    def address_from_here(self) -> str:
        """host:port a client on this machine reaches the gateway at (a wildcard host means loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def listen_address(self) -> str:
        """host:port the gateway listens on, an IPv6 host in brackets (`[::]:8000`, not `:::8000`)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        """Origins as browsers send them: lower case, no default port (matched exactly)."""
        origins = []
        for given in value:
            origin = given.lower()
            found = re.fullmatch(r"(https?)://([a-z0-9.-]+|\[[0-9a-f:.]+\])(?::(\d{1,5}))?", origin)
            if origin != "*" and found is None:
                raise ValueError(
                    f"{given!r} is not an origin: * or scheme://host[:port], with no path or trailing slash"
                )
            if found is not None and found[3] == {"http": "80", "https": "443"}[found[1]]:
                origin = f"{found[1]}://{found[2]}"
            origins.append(origin)
        return origins

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or network (e.g. 10.0.0.0/8)") from None
        return value


class SupervisorSettings(Strict):
    """Probing and restart policy for replicas (seconds)."""

    probe_interval: Annotated[float, Field(gt=0, description="seconds between health/metrics probes")] = 2.0
    probe_timeout: Annotated[float, Field(gt=0, description="seconds one probe may take")] = 2.0
    unhealthy_after: Annotated[
        int, Field(ge=1, description="failed probes in a row before a replica is restarted")
    ] = 3
    ready_timeout: Annotated[float, Field(gt=0, description="seconds a replica may take to become ready")] = (
        180.0
    )
    backoff_initial: Annotated[float, Field(gt=0, description="seconds before the first restart")] = 0.5
    backoff_max: Annotated[float, Field(gt=0, description="longest wait between restarts, seconds")] = 30.0
    stop_timeout: Annotated[
        float, Field(gt=0, description="seconds between SIGTERM and SIGKILL when stopping a replica")
    ] = 10.0
    max_start_failures: Annotated[
        int,
        Field(
            ge=1,
            description="starts in a row that fail before ready, after which a replica is given up (failed)",
        ),
    ] = 5
    replica_log_max_mb: Annotated[
        float,
        Field(gt=0, description="a replica's log file is rotated once it is larger than this (MiB)"),
    ] = 100.0
    replica_log_keep: Annotated[
        int,
        Field(ge=0, description="rotated copies of a replica's log kept (<replica>.log.1 newest; 0: none)"),
    ] = 3


class StoreSettings(Strict):
    """Where keys and usage live: a SQLAlchemy URL (default: SQLite file in corral's home)."""

    url: str | None = Field(
        default=None,
        description="sqlite:///path or postgresql://user@host/db; a SQLite file in corral's home when unset",
    )
    flush_interval: Annotated[
        float, Field(gt=0, description="seconds between batched writes of usage records")
    ] = 1.0
    max_pending: Annotated[
        int,
        Field(
            ge=100, description="usage records held while the store is down; beyond it the oldest are dropped"
        ),
    ] = 100_000
    response_ttl_days: Annotated[
        float,
        Field(
            gt=0,
            description="days a stored response (/v1/responses with store: true) is kept for "
            "previous_response_id and retrieval (OpenAI keeps them 30)",
        ),
    ] = 30
    response_tenant_max_bytes: Annotated[
        int,
        Field(
            ge=1024,
            description="bytes of stored responses one tenant keeps (each holds its whole conversation); "
            "past it the tenant's own oldest are deleted, never another tenant's (checked each sixteenth "
            "of it a gateway process stores)",
        ),
    ] = 1024 * 1024 * 1024
    usage_retention_days: Annotated[int, Field(ge=32)] | None = Field(
        default=None,
        description="days usage records are kept (at least 32: monthly budgets count this calendar month's); "
        "unset: kept for ever",
    )
    audit_retention_days: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="days audit records are kept; unset: kept for ever"
    )


class LimitsSettings(Strict):
    """Rate-limit and budget state: in this process (`memory`), or in Redis so limits and monthly budgets
    hold across gateway replicas."""

    backend: Literal["memory", "redis"] = Field(
        default="memory",
        description="memory (one gateway) or redis (RPM/TPM/concurrency limits and the monthly budgets' "
        "reservations shared by gateways)",
    )
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis for backend: redis")
    redis_timeout: Annotated[
        float, Field(gt=0, description="seconds to connect to Redis and for each limit check")
    ] = 0.5
    on_redis_error: Literal["open", "closed"] = Field(
        default="open",
        description="when Redis does not answer: open serves the request (logged, counted in "
        "corral_limiter_errors_total), closed refuses it with 503 limits_unavailable and Retry-After",
    )
    window_s: Annotated[float, Field(gt=0, description="seconds over which RPM and TPM are counted")] = 60.0
    tokens_per_char: Annotated[float, Field(gt=0, description="input-token estimate per body byte")] = 0.25


class CacheSettings(Strict):
    """Where cached answers live (models opt in with `models[].cache`): this process's memory, an LRU
    bounded in bytes, or Redis with each entry's TTL, shared by every gateway using it."""

    backend: Literal["memory", "redis"] = Field(
        default="memory", description="memory (one gateway process) or redis (shared by gateways)"
    )
    max_bytes: Annotated[int, Field(ge=0, description="memory: the most bytes of answers kept (LRU)")] = (
        256 * 1024 * 1024
    )
    tenant_max_bytes: Annotated[
        int | None,
        Field(
            ge=1,
            description="the most bytes of answers one tenant keeps (past it, its own oldest go, never "
            "another tenant's); default: max_bytes. With redis, Redis's maxmemory bounds the whole",
        ),
    ] = None
    max_entry_bytes: Annotated[
        int, Field(ge=1, description="the most bytes of one answer kept (a larger one is served, not cached)")
    ] = 1024 * 1024
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis for backend: redis")
    redis_timeout: Annotated[
        float, Field(gt=0, description="seconds for each Redis call; a slow cache is skipped, not waited on")
    ] = 0.5
    embedding_timeout: Annotated[
        float,
        Field(gt=0, description="semantic cache: seconds to embed a question before the lookup is a miss"),
    ] = 2.0


class BatchSettings(Strict):
    """Batch jobs (OpenAI's Files and Batch API): a durable queue in the store, run on spare capacity."""

    @property
    def file_expiry(self) -> timedelta:
        return timedelta(days=self.file_expiry_days)

    enabled: bool = Field(default=True, description="serve /v1/files and /v1/batches and run batches")
    queue: Literal["sql", "redis"] = Field(
        default="sql",
        description="where batch lines queue: sql (the store: SQLite, or PostgreSQL with SKIP LOCKED "
        "leases) or redis (Redis Streams with a consumer group; batches and files stay in the store)",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis for queue: redis (run it with appendonly yes: the lines live there)",
    )
    max_file_bytes: Annotated[int, Field(ge=1, description="largest file upload, bytes")] = 100 * 1024 * 1024
    tenant_max_active: Annotated[
        int,
        Field(ge=1, description="batches one tenant may have unfinished at once (one more: 429)"),
    ] = 20
    tenant_max_files: Annotated[
        int, Field(ge=1, description="files one tenant may hold at once (an upload past it: 429)")
    ] = 1000
    tenant_max_bytes: Annotated[
        int,
        Field(
            ge=1,
            description="bytes of files (uploads and results, with its running batches' results so far) "
            "one tenant may hold at once; past it, its batches' lines left fail with files_quota_exceeded",
        ),
    ] = 10 * 1024 * 1024 * 1024
    tenant_max_uploads: Annotated[
        int,
        Field(
            ge=1,
            description="uploads one tenant may send at once to a gateway worker (one more: 429 with "
            "Retry-After); each is refused as it arrives once it would pass the tenant's tenant_max_bytes",
        ),
    ] = 2
    max_lines: Annotated[int, Field(ge=1, description="requests a batch file may hold")] = 50_000
    file_expiry_days: Annotated[
        int,
        Field(
            ge=1,
            description="days after which uploads and batch results are deleted (OpenAI's default for batch "
            "files: 30); an upload's expires_after may set fewer",
        ),
    ] = 30
    headroom: Annotated[
        int, Field(ge=0, description="slots per model kept free of batch lines for interactive requests")
    ] = 1
    max_share: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="the most of a model's slots batch lines hold at once (the rest stays free for "
            "interactive bursts; measured: benchmarks/batch_interference.py)",
        ),
    ] = 0.8
    reserve_window_s: Annotated[
        float,
        Field(
            ge=0,
            description="batch lines leave free the most slots interactive requests held at once over this "
            "many seconds",
        ),
    ] = 60.0
    lease_s: Annotated[
        float,
        Field(gt=0, description="a running line's lease: a gateway that dies holds its lines this long"),
    ] = 300.0
    poll_s: Annotated[float, Field(gt=0, description="how often the runner looks for spare capacity")] = 0.5
    max_attempts: Annotated[
        int, Field(ge=1, description="tries of a line the cluster could not take (429, 5xx) before it fails")
    ] = 5


class QueueSettings(Strict):
    """Per-model waiting room in front of the replicas."""

    max_queued: Annotated[
        int,
        Field(
            ge=0,
            description="requests waiting per model; while several tenants wait, each holds at most its "
            "priority-weighted share (over it: 429 queue_share_exceeded); full for one tenant alone: 503",
        ),
    ] = 1024
    timeout: Annotated[
        float, Field(gt=0, description="seconds a request may wait for a replica before 503")
    ] = 30.0


class RaySettings(Strict):
    """Run replicas as Ray actors: join the cluster at `address` ("auto": the local node's), or start one."""

    address: str | None = Field(
        default=None, description="a Ray cluster address, 'auto' (this node's cluster), or unset to start one"
    )
    placement_timeout: Annotated[
        float, Field(gt=0, description="seconds to wait for room on the cluster for a replica")
    ] = 60.0
    shared_files: bool = Field(
        default=True,
        description="Ray's nodes read what corral prepares here at the same paths (hosts set up as the Ray "
        "guide says); false where they have only their image (KubeRay's worker pods, which the render "
        "sets): replicas that need prepared files (llama.cpp, weights corral fetches, LoRA adapters) are "
        "refused, also by a live apply",
    )


class EdgeSettings(Strict):
    """The NGINX edge `corral deploy render --target nginx` writes: TLS, per-client limits, the gateways."""

    server_name: str = Field(default="localhost", description="the edge's host name (TLS certificate name)")
    port: Annotated[int, Field(ge=1, le=65535, description="HTTPS port the edge listens on")] = 443
    cert: Path = Field(
        default=Path("/etc/corral/tls/server.crt"), description="PEM certificate chain the edge serves"
    )
    key: Path = Field(default=Path("/etc/corral/tls/server.key"), description="its private key (PEM)")
    gateways: list[str] = Field(
        default_factory=list,
        description="host:port of each corral gateway behind the edge (default: the spec's gateway)",
    )
    requests_per_second: Annotated[
        float, Field(gt=0, description="requests per second one client address may send (429 beyond)")
    ] = 20.0
    burst: Annotated[int, Field(ge=0, description="requests over the rate a client may send at once")] = 40
    connections_per_client: Annotated[
        int, Field(ge=1, description="open connections per client address (429 beyond)")
    ] = 64
    fail_timeout: Annotated[
        float, Field(gt=0, description="seconds the edge skips a gateway it could not connect to")
    ] = 10.0
    hsts_max_age: Annotated[
        int, Field(ge=0, description="Strict-Transport-Security max-age, seconds (0: no HSTS header)")
    ] = 63072000


class DeploySettings(Strict):
    """What `corral deploy render` needs beyond the cluster itself: the edge, images, the service user."""

    edge: EdgeSettings = Field(default_factory=EdgeSettings, description="the NGINX TLS edge")
    image: str = Field(
        default="corral:0.1.0", description="Compose/KubeRay: the image with corral (CPU engines included)"
    )
    vllm_image: str = Field(
        default="corral-vllm:0.1.0",
        description="Compose/KubeRay: the image with vLLM, Ray and corral preinstalled (never a pip "
        "install at start-up)",
    )
    vllm_python: Path = Field(
        default=Path("/usr/bin/python3"), description="the interpreter that imports vLLM in vllm_image"
    )
    namespace: str = Field(default="corral", description="KubeRay: the Kubernetes namespace")
    user: str = Field(default="corral", description="systemd: the dedicated user the service runs as")
    runbook_url: str | None = Field(
        default=None,
        description="alert rules: the absolute URL where your on-call reads corral's alert runbook "
        "(docs/reference/alerts.md on the documentation site or a wiki); each alert links to its section. "
        "Unset: `corral observe render` writes the runbook beside the rules and links to that file (file://)",
    )

    @field_validator("runbook_url")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("https://", "http://", "file:///")):
            raise ValueError("runbook_url must be absolute (https://…, http://… or file:///…)")
        return value
