"""How a running model changes: its rollout policy (with the golden eval gate) and its autoscaling bounds.

Both are live settings: `corral apply` changes them without a rollout.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from corral.config.base import Strict


class EvalCase(Strict):
    """One golden prompt a candidate replica must answer right before it gets traffic (temperature 0).

    Exactly one check: `exact` (the whole answer, whitespace trimmed), `contains`, `regex` (searched), or
    `json_schema` (the answer parses as JSON and validates; `{}`: any JSON). Each is checked here, at load:
    a regex that does not compile or a schema that is not one would otherwise fail only during a rollout,
    after its new replicas started; an empty `contains` or `regex` would pass every answer."""

    name: str | None = Field(default=None, description="shown when the check fails")
    prompt: str | None = Field(default=None, description="a user message (chat) to send")
    messages: list[dict[str, Any]] | None = Field(default=None, description="a whole chat instead of prompt")
    max_tokens: Annotated[int, Field(ge=1, le=4096, description="tokens the answer may take")] = 32
    exact: str | None = Field(default=None, description="the answer must be exactly this")
    contains: str | None = Field(default=None, description="the answer must contain this")
    regex: str | None = Field(default=None, description="the answer must match this (re.search)")
    json_schema: dict[str, Any] | None = Field(default=None, description="the answer is JSON valid here")

    @field_validator("contains", "regex")
    @classmethod
    def _not_empty(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value == "":
            raise ValueError(f"an empty {info.field_name} passes every answer: say what the answer must hold")
        return value

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"regex {value!r} is not a valid regular expression: {exc}") from exc
        return value

    @field_validator("json_schema")
    @classmethod
    def _is_a_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            import jsonschema  # (only for specs that use it: it adds a tenth of a second to every CLI start)

            try:
                jsonschema.validators.validator_for(value).check_schema(value)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"json_schema is not a valid JSON Schema: {exc.message}") from exc
        return value

    @model_validator(mode="after")
    def _one_input_one_check(self) -> EvalCase:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("an eval case needs exactly one of 'prompt' and 'messages'")
        checks = [c for c in (self.exact, self.contains, self.regex, self.json_schema) if c is not None]
        if len(checks) != 1:
            raise ValueError("an eval case needs exactly one check: exact, contains, regex or json_schema")
        return self

    @property
    def label(self) -> str:
        return self.name or (self.prompt or "messages")[:40]


class RolloutSpec(Strict):
    """How a change of a model's weights, engine or arguments reaches traffic (`corral apply`).

    `rolling` starts one new replica at a time (surge 1) and drains an old one for each (on GPUs with none
    spare, the old one first); `blue_green` starts them all, then shifts traffic and drains every old one.
    Either way each new replica must start, answer the golden eval, then take the traffic steps with a
    health check between; a failure rolls back with the old replicas serving throughout."""

    strategy: Literal["rolling", "blue_green"] = Field(
        default="rolling",
        description="rolling (surge 1; with no spare GPU, one old replica is drained first) or blue_green "
        "(all new replicas at once: needs spare GPUs for all of them)",
    )
    steps: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [0.1, 0.5, 1.0],
        description="shares of the model's traffic sent to the first new replicas, one step at a time "
        "(rolling: capped at their share by count)",
    )
    step_s: Annotated[float, Field(ge=0, le=3600, description="seconds each traffic step is watched")] = 30.0
    max_error_ratio: Annotated[
        float, Field(ge=0, le=1, description="roll back when more of the new replicas' requests fail")
    ] = 0.05
    max_ttft_ratio: Annotated[float, Field(gt=1)] | None = Field(
        default=2.0,
        description="roll back when the new replicas' engine TTFT exceeds the old ones' by this factor "
        "(engines that report TTFT: vllm, sim)",
    )
    ready_timeout_s: Annotated[
        float, Field(gt=0, description="a new replica not ready by then fails the rollout")
    ] = 900.0
    golden_eval: list[EvalCase] = Field(
        default_factory=list, description="prompts each new replica must answer right before it serves"
    )
    eval_latency_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="each golden answer must arrive within this many seconds"
    )

    @field_validator("steps")
    @classmethod
    def _rising(cls, steps: list[float]) -> list[float]:
        if not steps or steps != sorted(steps):
            raise ValueError("steps must be a rising list of traffic shares, e.g. [0.1, 0.5, 1.0]")
        return steps

    def refusal(self, task: str) -> str | None:
        """Why this policy cannot gate a model of `task` (its `task`: generate or embed), or None. The golden
        cases check generated text; an embedding model answers with vectors, so its gate is the warm-up's
        embedding alone."""
        if task == "embed" and self.golden_eval:
            return (
                "rollout.golden_eval checks generated text, and an embedding model (task: embed) answers "
                "with vectors: its new replicas are gated by an embedding warm-up; remove golden_eval"
            )
        return None


class AutoscaleSpec(Strict):
    """Replica bounds and when to move between them (one deployment of a model).

    Scale up when the oldest queued request waited `queue_wait_s`, or the replicas' busy slots exceed
    `target_utilization`, or KV-cache use passes `kv_usage_high`, or prompt tokens waiting for prefill pass
    `prefill_tokens_high` per replica; replicas still loading count as capacity already on the way. Scale
    down, one drained replica at a time, after `down_cooldown_s` of wanting fewer (those over a lowered
    `max_replicas` at once). Batch lines, which run on spare capacity, are not sized for: a model with lines
    to run keeps (or wakes) one replica. `feed_forward` also sizes for the measured arrival rate with the
    performance model (engines with a GPU type: sim, vllm)."""

    min_replicas: Annotated[
        int, Field(ge=0, le=256, description="never fewer (0: scale to zero when idle)")
    ] = 1
    max_replicas: Annotated[int, Field(ge=1, le=256, description="never more")]
    mode: Literal["reactive", "feed_forward"] = Field(
        default="reactive",
        description="reactive, or feed_forward (sizes for the arrival rate too, with the perf catalog's "
        "model: the model's arch must name one)",
    )
    target_utilization: Annotated[
        float, Field(gt=0, le=1, description="share of the replicas' slots busy that it aims for")
    ] = 0.7
    queue_wait_s: Annotated[
        float, Field(gt=0, description="scale up when a queued request has waited this long")
    ] = 1.0
    kv_usage_high: Annotated[
        float, Field(gt=0, le=1, description="scale up when mean KV-cache use passes this")
    ] = 0.9
    prefill_tokens_high: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="scale up when prompt tokens awaiting prefill per replica pass this"
    )
    interval_s: Annotated[float, Field(gt=0, le=300, description="seconds between decisions")] = 2.0
    down_cooldown_s: Annotated[
        float, Field(ge=0, description="seconds of wanting fewer replicas before one is drained")
    ] = 60.0
    hold_s: Annotated[
        float, Field(gt=0, description="scaled to zero: how long requests wait for the first replica")
    ] = 120.0
    drain_grace_s: Annotated[float, Field(gt=0, le=86400)] | None = Field(
        default=None,
        description="how long a replica scaled down may finish its requests before those still running are "
        "cut (unset: the longer of 120 s and gateway.shutdown_grace; long streams want more)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        return self


class ModelCacheSpec(Strict):
    """A model's exact response cache (cluster-wide storage: `cache`). A hit needs the same tenant, model,
    endpoint and everything that shapes the answer (messages or prompt, sampling parameters, tools,
    response format; not `user`, not `stream`)."""

    exact: bool = Field(default=False, description="answer repeated requests from the cache")
    deterministic_only: bool = Field(
        default=True, description="cache only requests with temperature 0 or a seed (sampled answers vary)"
    )
    ttl_s: Annotated[float, Field(gt=0, description="seconds an answer stays cached")] = 3600.0
    charge: Literal["tokens", "request"] = Field(
        default="tokens",
        description="what a hit costs against rate limits and budgets: the answer's tokens, or the request "
        "only (no tokens)",
    )
    semantic: bool = Field(
        default=False,
        description="also answer a chat request whose earlier turns and parameters match a cached one "
        "exactly and whose last user turn is similar enough (embedding cosine) to its last user turn",
    )
    embedding_model: str | None = Field(
        default=None, description="semantic: the served embedding model (task: embed) that compares turns"
    )
    similarity: Annotated[
        float, Field(gt=0, le=1, description="semantic: cosine a last user turn needs for a hit (fixed)")
    ] = 0.92
    guard: bool = Field(
        default=True,
        description="semantic: refuse hits between questions with other numbers, swapped directions "
        "(X to Y / Y to X) or one swapped word (Saturday / Sunday), which embeddings barely tell apart",
    )
    learn_thresholds: bool = Field(
        default=False,
        description="semantic: learn each entry's threshold from answers checked against the engine "
        "(vCache), keeping false hits under target_false_hit_rate, instead of the fixed similarity",
    )
    target_false_hit_rate: Annotated[
        float, Field(gt=0, lt=0.5, description="learn_thresholds: the share of wrong hits it accepts")
    ] = 0.01

    @model_validator(mode="after")
    def _semantic_needs_embeddings(self) -> ModelCacheSpec:
        if self.semantic and not self.embedding_model:
            raise ValueError("cache.semantic needs cache.embedding_model: the model that embeds the turns")
        return self
