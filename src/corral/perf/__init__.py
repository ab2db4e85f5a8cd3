"""The performance model shared by the planner and the simulator: catalogs, memory, step time, scheduler."""

from corral.perf.catalog import GPU, ApiPrice, Catalog, CatalogError, ModelArch, Quantization, load_catalog
from corral.perf.memory import BLOCK_SIZE, GIB, MemoryPlan, memory_plan, sequence_kv_bytes, weight_bytes
from corral.perf.scheduler import Batch, BlockPool, EngineSequence, Scheduler, SchedulerConfig, block_hashes
from corral.perf.steps import StepPipeline
from corral.perf.timing import Efficiency, PerfModel, StepBreakdown, StepParts
from corral.perf.workload import KEEPS_UP, LoadResult, closed_loop, open_loop, saturated_rate

__all__ = [
    "BLOCK_SIZE",
    "GIB",
    "GPU",
    "KEEPS_UP",
    "ApiPrice",
    "Batch",
    "BlockPool",
    "Catalog",
    "CatalogError",
    "Efficiency",
    "EngineSequence",
    "LoadResult",
    "MemoryPlan",
    "ModelArch",
    "PerfModel",
    "Quantization",
    "Scheduler",
    "SchedulerConfig",
    "StepBreakdown",
    "StepParts",
    "StepPipeline",
    "block_hashes",
    "closed_loop",
    "load_catalog",
    "memory_plan",
    "open_loop",
    "saturated_rate",
    "sequence_kv_bytes",
    "weight_bytes",
]
