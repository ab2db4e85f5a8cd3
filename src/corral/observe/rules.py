"""Prometheus alert rules for a corral cluster and its GPUs (a rules file for `rule_files:`).

Thresholds come from the spec where it has them: each model's TTFT/ITL SLO (`models[].slo`), half the
queue timeout for queue waits. Every expression evaluates before the first error or refusal ever happens
(`or … * 0` where a series appears only with its first event), so no rule is silently empty. Each alert has
a severity, a summary and a runbook section in runbook.md (docs/reference/alerts.md), linked by an absolute
`runbook_url` (Alertmanager and Grafana cannot follow a relative one): `deploy.runbook_url#section`.

Gateway-side rules group by `instance`: each host runs its own gateway and replicas and the edge does not
retry across hosts, so one host without a ready replica refuses its share though another has one. The GPU
rules read dcgm-exporter; its stock field list leaves out the ECC and throttling counters, so
`corral observe render` writes a counters file to give it (dcgm.py), and the ECC rule also reads the row
remapping that the stock list keeps.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from corral.config import ClusterSpec, ModelSpec

__all__ = ["FATAL_XIDS", "RUNBOOK", "TOP_BUCKET_S", "AlertRule", "alert_rules", "rules_yaml"]

logger = logging.getLogger(__name__)

RUNBOOK = Path(__file__).with_name("runbook.md")  # one section per alert (docs/reference/alerts.md shows it)
# XIDs that mean the GPU or its driver failed (DBE ECC, row remapping, NVLink, fell off the bus, contained/
# uncontained ECC, GSP); 13, 31, 43 and 45 are mostly the application's own faults.
FATAL_XIDS = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120)
APPLICATION_XIDS = (13, 31, 43, 45)
# The top finite bucket of the gateway's latency histograms (gateway/metrics.py): histogram_quantile never
# reports more, so a rule asking for more could never fire.
TOP_BUCKET_S = {
    "corral_time_to_first_token_seconds": 600.0,
    "corral_queue_wait_seconds": 600.0,
    "corral_inter_token_latency_seconds": 5.0,
}
_VLLM_START_S = 600.0  # the longest vLLM may take to become ready (engines/vllm.py; not ready_timeout)


@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    duration: str
    severity: str
    summary: str
    group: str = "corral"
    labels: tuple[tuple[str, str], ...] = ()  # set on each alert, beside its severity

    def as_dict(self, runbook: str) -> dict[str, object]:
        """The rule for Prometheus; `runbook`: the runbook's absolute URL."""
        link = f"{runbook.split('#', 1)[0]}#{self.name.lower()}"
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.duration,
            "labels": {**dict(self.labels), "severity": self.severity},
            "annotations": {"summary": self.summary, "runbook_url": link},
        }


def _xid_match(codes: tuple[int, ...]) -> str:
    """The GPUs whose last XID is one of `codes` and changed in the last 10 minutes (the field holds the
    last XID for good: without the change it would fire forever after one event)."""
    matches = " or ".join(f"DCGM_FI_DEV_XID_ERRORS == {code}" for code in codes)
    return f"({matches}) and changes(DCGM_FI_DEV_XID_ERRORS[10m]) > 0"


def _any_of(names: list[str]) -> str:
    """A PromQL string's text for a regex matching exactly `names` (a model id may hold a dot)."""
    return "|".join(re.escape(name) for name in names).replace("\\", "\\\\")


def _on_demand(spec: ClusterSpec) -> dict[str, float]:
    """The models that may scale to zero, each with the longest `hold_s` its requests wait for a replica."""
    holds: dict[str, float] = {}
    for model in spec.models:
        for deployment in model.deployments:
            scale = deployment.autoscale
            if scale is not None and scale.min_replicas == 0:
                holds[model.name] = max(holds.get(model.name, 0.0), scale.hold_s)
    return holds


def _availability_rules(spec: ClusterSpec) -> list[AlertRule]:
    """No ready replica of a model on one gateway. A model scaled to zero holds its requests `hold_s` while
    its first replica starts (a vLLM start takes minutes): it alerts only when held requests are refused."""
    ready = "max by (instance, model) (corral_replica_ready{selector}) == 0"
    on_demand = _on_demand(spec)
    rules = [
        AlertRule(
            "CorralModelUnavailable",
            ready.replace("{selector}", f'{{model!~"{_any_of(list(on_demand))}"}}' if on_demand else ""),
            "1m",
            "critical",
            "Model {{ $labels.model }} has no ready replica on the gateway {{ $labels.instance }}: its "
            "requests there are refused with 503.",
        )
    ]
    by_hold: dict[float, list[str]] = {}
    for model, hold in on_demand.items():
        by_hold.setdefault(hold, []).append(model)
    for hold, models in sorted(by_hold.items()):
        rules.append(
            AlertRule(
                "CorralModelUnavailable",
                ready.replace("{selector}", f'{{model=~"{_any_of(models)}"}}'),
                f"{math.ceil(hold) + 60}s",  # its hold, and a minute for held requests to be refused
                "critical",
                "Model {{ $labels.model }} (scaled to zero) has no ready replica on the gateway "
                f"{{{{ $labels.instance }}}} past its hold_s of {hold:g} s: requests held for it are refused "
                "with 503.",
            )
        )
    return rules


def _p95_over(
    metric: str, bound: float, what: str, selector: str = "", by: str = "model, le"
) -> tuple[str, str]:
    """The PromQL of `metric`'s p95 (of the series `selector` picks, summed `by`) over `bound`, and what a
    summary adds to the bound. A bound at or above the histogram's top finite bucket is clamped to it, with
    a warning: the p95 never reads more, so the rule would never fire; at the top bucket it fires once the
    p95 is past it, before `bound`."""
    quantile = f"histogram_quantile(0.95, sum by ({by}) (rate({metric}_bucket{selector}[5m])))"
    top = TOP_BUCKET_S[metric]
    if bound < top:
        return f"{quantile} > {bound:g}", ""
    logger.warning(
        "alert rules: %s of %g s is not below %g s, the top bucket of %s, past which the p95 cannot be "
        "told: the alert fires once the p95 is past %g s instead",
        what,
        bound,
        top,
        metric,
        top,
    )
    return f"{quantile} >= {top:g}", f"; alerting past {top:g} s, the most the histogram tells"


def _replica_rules(spec: ClusterSpec) -> list[AlertRule]:
    """A replica out of service that is not starting (a vLLM start takes minutes), and one starting for
    longer than a start may take: waiting for room on a Ray cluster (never given up), or starts that keep
    failing late (each a restart, too far apart for CorralReplicaRestartLoop)."""
    rules = [
        AlertRule(
            "CorralReplicaDown",
            'corral_replica_ready == 0 unless ignoring(state) corral_replica_state{state="starting"} == 1',
            "5m",
            "warning",
            "Replica {{ $labels.replica }} of {{ $labels.model }} has been out of service (not starting) "
            "for 5 minutes.",
        )
    ]
    by_allowance: dict[float, list[str]] = {}
    for model in spec.models:
        by_allowance.setdefault(_start_allowance(spec, model), []).append(model.name)
    for allowance, models in sorted(by_allowance.items()):
        selector = f'state="starting", model=~"{_any_of(models)}"'
        rules.append(
            AlertRule(
                "CorralReplicaStartSlow",
                f"corral_replica_state{{{selector}}} == 1",
                f"{math.ceil(allowance) + 300}s",  # the longest start, and 5 minutes
                "warning",
                "Replica {{ $labels.replica }} of {{ $labels.model }} has been starting for longer than a "
                f"start may take ({allowance:g} s): it waits for room on the Ray cluster, or its starts "
                "keep failing; see its last_error in /corral/status, and its log.",
            )
        )
    return rules


def _start_allowance(spec: ClusterSpec, model: ModelSpec) -> float:
    """The longest one start of the model's replicas may take before the supervisor gives it up."""
    vllm = any(deployment.engine == "vllm" for deployment in model.deployments)
    return max(spec.supervisor.ready_timeout, _VLLM_START_S if vllm else 0.0)


def alert_rules(spec: ClusterSpec) -> list[AlertRule]:
    queue_wait = spec.queue.timeout / 2
    queue_expr, clamped = _p95_over(
        "corral_queue_wait_seconds", queue_wait, "half the queue timeout (queue.timeout / 2)"
    )
    rules = [
        AlertRule(
            "CorralGatewayDown",
            'up{job="corral-gateway"} == 0 or absent(up{job="corral-gateway"})',
            "1m",
            "critical",
            "The corral gateway {{ $labels.instance }} does not answer Prometheus's scrapes.",
        ),
        *_availability_rules(spec),
        *_replica_rules(spec),
        AlertRule(
            "CorralReplicaRestartLoop",
            "increase(corral_replica_restarts_total[15m]) >= 3",
            "0m",
            "warning",
            "Replica {{ $labels.replica }} of {{ $labels.model }} restarted 3 times or more in 15 "
            "minutes: see its log for the cause.",
        ),
        AlertRule(
            "CorralErrorRatioHigh",
            '(sum by (model) (rate(corral_requests_total{status=~"5.."}[5m])) '
            "or sum by (model) (rate(corral_requests_total[5m])) * 0) "
            "/ sum by (model) (rate(corral_requests_total[5m])) > 0.05",
            "5m",
            "critical",
            "{{ $labels.model }}: {{ $value | humanizePercentage }} of requests end in a server error.",
        ),
        AlertRule(
            "CorralQueueWaitHigh",
            queue_expr,
            "5m",
            "warning",
            f"{{{{ $labels.model }}}}: p95 queue wait {{{{ $value | humanizeDuration }}}} "
            f"(over {queue_wait:g} s, half the queue timeout{clamped}): add replicas.",
        ),
        AlertRule(
            "CorralKVCacheFull",
            "corral_engine_kv_cache_usage_ratio >= 0.95",
            "10m",
            "warning",
            "Replica {{ $labels.replica }} of {{ $labels.model }} has used ≥ 95% of its KV cache for 10 "
            "minutes.",
        ),
        AlertRule(
            "CorralPreemptions",
            "sum by (model) (rate(corral_engine_preemptions_total[5m])) > 0.5",
            "10m",
            "warning",
            "{{ $labels.model }}: engines preempt more than one sequence every 2 s (KV cache too small "
            "for the load).",
        ),
        AlertRule(
            "CorralRateLimitSpike",
            "(sum by (model) (rate(corral_rejections_total"
            '{reason=~"rate_limit_exceeded|insufficient_quota"}[5m])) '
            "or sum by (model) (rate(corral_requests_total[5m])) * 0) "
            "/ sum by (model) (rate(corral_requests_total[5m])) > 0.2",
            "10m",
            "warning",
            "{{ $labels.model }}: {{ $value | humanizePercentage }} of requests are refused by rate "
            "limits or budgets.",
        ),
        AlertRule(
            # Sustained: one failed call (a connection reset, a busy SQLite lock) is harmless, as the key
            # cache and the usage writer's retries ride it out; an outage fails every flush_interval.
            "CorralStoreUnreachable",
            "sum by (instance) (increase(corral_store_errors_total[5m])) >= 5",
            "5m",
            "critical",
            "The gateway {{ $labels.instance }} gets no answer from corral's store: keys it has not "
            "looked up yet, stored responses and the admin API are refused with 503, usage waits in memory.",
        ),
        AlertRule(
            "CorralUsageRecordsDropped",
            "increase(corral_usage_dropped_total[15m]) > 0",
            "0m",
            "critical",
            "The gateway {{ $labels.instance }} dropped usage records (the store was unreachable past "
            "store.max_pending): usage reports and monthly budgets undercount.",
        ),
        _limiter_rule(spec),
        AlertRule(
            "CorralTenantBudgetNearlySpent",
            "corral_key_budget_used_ratio >= 0.9",
            "0m",
            "info",
            "Key {{ $labels.key }} of tenant {{ $labels.tenant }} has used {{ $value | humanizePercentage }} "
            "of its monthly token budget.",
        ),
    ]
    rules += _slo_rules(spec)
    rules += _gpu_rules()
    return rules


def _limiter_rule(spec: ClusterSpec) -> AlertRule:
    """Redis, which holds the rate limits shared by gateways, does not answer (sustained, not one blip)."""
    if spec.limits.on_redis_error == "open":
        effect = "its requests are served without their rate limits (limits.on_redis_error: open)"
    else:
        effect = "its requests are refused with 503 limits_unavailable (limits.on_redis_error: closed)"
    return AlertRule(
        "CorralRateLimiterUnreachable",
        "increase(corral_limiter_errors_total[5m]) > 0",
        "5m",
        "warning",
        f"The gateway {{{{ $labels.instance }}}} cannot check rate limits in Redis: {effect}.",
    )


def _slo_rules(spec: ClusterSpec) -> list[AlertRule]:
    """A model's TTFT/ITL p95 over its SLO. The gateway labels an adapter's requests with the adapter's
    name; they run on the model's replicas, so they count towards its SLO (one p95 over all of them)."""
    rules = []
    for model in spec.models:
        if model.slo is None:
            continue
        names = [model.name, *(adapter.name for adapter in model.adapters)]
        selector = f'{{model="{model.name}"}}' if len(names) == 1 else f'{{model=~"{_any_of(names)}"}}'
        for kind, metric, bound in (
            ("TTFT", "corral_time_to_first_token_seconds", model.slo.ttft_p95),
            ("ITL", "corral_inter_token_latency_seconds", model.slo.itl_p95),
        ):
            if bound is None:
                continue
            expr, clamped = _p95_over(
                metric, bound, f"model {model.name!r}'s slo.{kind.lower()}_p95", selector, by="le"
            )
            rules.append(
                AlertRule(
                    f"Corral{kind}SLOBreached",
                    expr,
                    "5m",
                    "warning",
                    f"{model.name}: {kind} p95 {{{{ $value | humanizeDuration }}}} is over its SLO of "
                    f"{bound:g} s{clamped}.",
                    labels=(("model", model.name),),
                )
            )
    return rules


def _gpu_rules() -> list[AlertRule]:
    return [
        AlertRule(
            "CorralGPUFatalXID",
            f"count by (Hostname, gpu, UUID) ({_xid_match(FATAL_XIDS)}) > 0",
            "0m",
            "critical",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported a fatal XID: drain its replicas and "
            "reset it.",
            "corral-gpu",
        ),
        AlertRule(
            "CorralGPUApplicationXID",
            f"count by (Hostname, gpu, UUID) ({_xid_match(APPLICATION_XIDS)}) > 0",
            "0m",
            "info",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reported an application XID (engine fault, not "
            "the hardware).",
            "corral-gpu",
        ),
        AlertRule(
            # DBE_VOL_TOTAL needs corral's counters file (dcgm.py); the stock exporter keeps the rows an
            # uncorrectable error had remapped (Ampere and later)
            "CorralGPUECCDoubleBit",
            "increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL[10m]) > 0 "
            "or increase(DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS[10m]) > 0",
            "0m",
            "critical",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} had uncorrectable (double-bit) ECC errors.",
            "corral-gpu",
        ),
        AlertRule(
            "CorralGPURowRemapFailure",
            "DCGM_FI_DEV_ROW_REMAP_FAILURE > 0",
            "0m",
            "critical",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} failed to remap a memory row: replace it.",
            "corral-gpu",
        ),
        # The violation counters (microseconds held down) need corral's counters file (dcgm.py).
        AlertRule(
            "CorralGPUThermalThrottling",
            "rate(DCGM_FI_DEV_THERMAL_VIOLATION[5m]) / 1e6 > 0.1",
            "10m",
            "warning",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} is held down by temperature "
            "{{ $value | humanizePercentage }} of the time.",
            "corral-gpu",
        ),
        AlertRule(
            "CorralGPUPowerThrottling",
            "rate(DCGM_FI_DEV_POWER_VIOLATION[5m]) / 1e6 > 0.2",
            "15m",
            "warning",
            "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} is held down by its power limit "
            "{{ $value | humanizePercentage }} of the time.",
            "corral-gpu",
        ),
        AlertRule(
            "CorralGPUMissing",
            "last_over_time(DCGM_FI_DEV_GPU_TEMP[24h] offset 5m) "
            "unless on (Hostname, UUID) DCGM_FI_DEV_GPU_TEMP",
            "5m",
            "critical",
            "GPU {{ $labels.UUID }} on {{ $labels.Hostname }} stopped reporting (fell off the bus or the "
            "exporter lost it); the alert holds for a day.",
            "corral-gpu",
        ),
    ]


def rules_yaml(spec: ClusterSpec, runbook: str | None = None) -> dict[str, object]:
    """The rules file; alerts link to `deploy.runbook_url`, else to `runbook` (where the runbook was
    written), else to the one installed with corral."""
    link = spec.deploy.runbook_url or runbook or RUNBOOK.resolve().as_uri()
    groups: dict[str, list[dict[str, object]]] = {}
    for rule in alert_rules(spec):
        groups.setdefault(rule.group, []).append(rule.as_dict(link))
    return {"groups": [{"name": name, "rules": rules} for name, rules in groups.items()]}
