"""tpcompile: automatic Megatron-style tensor parallelism for PyTorch, planned on the FX graph."""

from tpcompile.api import parallelize, plan_model
from tpcompile.errors import CaptureError, MeshError, PlanMismatchError, TPCompileError
from tpcompile.graph_diff import GraphDiff, diff
from tpcompile.plan import ShardingPlan
from tpcompile.report import Report, explain
from tpcompile.runtime import TPModule, gather_full
from tpcompile.vocab import sharded_cross_entropy

__all__ = [
    "parallelize", "plan_model", "explain", "diff", "Report", "GraphDiff", "ShardingPlan",
    "TPModule", "gather_full", "sharded_cross_entropy",
    "TPCompileError", "CaptureError", "MeshError", "PlanMismatchError",
]
__version__ = "0.1.0"
