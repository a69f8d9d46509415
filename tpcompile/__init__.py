"""tpcompile: automatic Megatron-style tensor parallelism for PyTorch, planned on the FX graph."""

from tpcompile.api import parallelize, plan_model
from tpcompile.dynamo_backend import backend, parallelized
from tpcompile.errors import CaptureError, MeshError, PlanMismatchError, TPCompileError
from tpcompile.inductor import compile_options, mark_dynamic
from tpcompile.plan import ShardingPlan
from tpcompile.runtime import TPModule, gather_full

__all__ = [
    "parallelize", "plan_model", "ShardingPlan", "TPModule", "gather_full",
    "backend", "parallelized", "compile_options", "mark_dynamic",
    "TPCompileError", "CaptureError", "MeshError", "PlanMismatchError",
]
__version__ = "0.1.0"
