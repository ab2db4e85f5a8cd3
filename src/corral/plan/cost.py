"""What a layout costs, per month and per million tokens, and when it beats a hosted API.

monthly cost          = GPU-hours price · GPUs · 730 h
cost per 1M tokens    = hourly cost / (tokens per hour at the planned load) · 10^6   (input + output tokens)
API cost per hour     = requests/s · 3600 · (input · input price + output · output price) / 10^6
break-even            = the request rate at which the API bill equals the cluster's fixed cost (said beside
                        the planned load: below it, the API is cheaper at that load)
"""

from __future__ import annotations

from dataclasses import dataclass

from corral.perf import ApiPrice

__all__ = ["CostReport", "cost_report"]

HOURS_PER_MONTH = 730


@dataclass(frozen=True)
class CostReport:
    hourly_usd: float
    monthly_usd: float
    cost_per_million_tokens: float
    cost_per_million_output_tokens: float
    api: str
    api_cost_per_million_tokens: float
    api_monthly_usd_at_this_load: float
    break_even_requests_per_day: float
    reaches_break_even: bool  # the planned load is at least the break-even
    cheaper_than_api: bool

    def to_dict(self) -> dict[str, object]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def cost_report(
    hourly_usd: float, requests_per_s: float, input_len: int, output_len: int, api: ApiPrice
) -> CostReport:
    tokens_per_hour = requests_per_s * 3600 * (input_len + output_len)
    output_per_hour = requests_per_s * 3600 * output_len
    api_per_request = (input_len * api.input_per_m + output_len * api.output_per_m) / 1e6
    api_monthly = api_per_request * requests_per_s * 3600 * HOURS_PER_MONTH
    monthly = hourly_usd * HOURS_PER_MONTH
    break_even = hourly_usd * 24 / api_per_request if api_per_request else float("inf")
    return CostReport(
        hourly_usd=hourly_usd,
        monthly_usd=monthly,
        cost_per_million_tokens=hourly_usd / tokens_per_hour * 1e6 if tokens_per_hour else float("inf"),
        cost_per_million_output_tokens=hourly_usd / output_per_hour * 1e6
        if output_per_hour
        else float("inf"),
        api=api.name,
        api_cost_per_million_tokens=api_per_request / (input_len + output_len) * 1e6,
        api_monthly_usd_at_this_load=api_monthly,
        break_even_requests_per_day=break_even,
        reaches_break_even=break_even <= requests_per_s * 86400,
        cheaper_than_api=monthly < api_monthly,
    )
