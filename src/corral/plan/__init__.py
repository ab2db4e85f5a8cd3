"""`corral plan`: size a cluster for a model, load and SLOs, and what it costs against an API."""

from corral.plan.cost import CostReport, cost_report
from corral.plan.render import plan_json, plan_table, plan_yaml
from corral.plan.search import Layout, PlanRequest, PlanResult, plan

__all__ = [
    "CostReport",
    "Layout",
    "PlanRequest",
    "PlanResult",
    "cost_report",
    "plan",
    "plan_json",
    "plan_table",
    "plan_yaml",
]
