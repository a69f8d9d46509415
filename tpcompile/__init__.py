"""tpcompile: automatic Megatron-style tensor parallelism for PyTorch, planned on the FX graph."""

from tpcompile.api import parallelize, plan_model
from tpcompile.checkpoint import sharded_state_dict
from tpcompile.dynamo_backend import backend, parallelized
from tpcompile.errors import (
    CaptureError, CollectiveError, InputError, MeshError, PlanError, PlanMismatchError, TPCompileError,
)
from tpcompile.graph_diff import GraphDiff, diff
from tpcompile.inductor import compile_options, mark_dynamic
from tpcompile.meta import buffers_of, init_shards, to_empty
from tpcompile.optim import clip_grad_norm_, grad_norm
from tpcompile.plan import ShardingPlan
from tpcompile.report import Report, explain
from tpcompile.runtime import TPModule, gather_full
from tpcompile.state import gather_state_dict, load_full_state_dict
from tpcompile.vocab import sharded_cross_entropy

__all__ = [
    "parallelize", "plan_model", "explain", "diff", "Report", "GraphDiff", "ShardingPlan",
    "TPModule", "gather_full", "sharded_cross_entropy",
    "backend", "parallelized", "compile_options", "mark_dynamic",
    "TPCompileError", "CaptureError", "MeshError", "PlanMismatchError", "PlanError", "InputError",
    "CollectiveError",
    "gather_state_dict", "load_full_state_dict", "sharded_state_dict",
    "to_empty", "init_shards", "buffers_of", "clip_grad_norm_", "grad_norm",
]
__version__ = "0.1.0"
