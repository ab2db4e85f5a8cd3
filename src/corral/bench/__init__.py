"""`corral bench`: load-test any OpenAI-compatible endpoint and report what it measured."""

from corral.bench.preflight import PreflightError, preflight
from corral.bench.report import compare, write_html, write_plots
from corral.bench.runner import LoadPlan, RequestResult, RunResult, run_load
from corral.bench.stats import Slo, distribution, summarise
from corral.bench.workloads import BenchRequest, random_requests, shared_prefix_requests, sharegpt_requests

__all__ = [
    "BenchRequest",
    "LoadPlan",
    "PreflightError",
    "RequestResult",
    "RunResult",
    "Slo",
    "compare",
    "distribution",
    "preflight",
    "random_requests",
    "run_load",
    "shared_prefix_requests",
    "sharegpt_requests",
    "summarise",
    "write_html",
    "write_plots",
]
