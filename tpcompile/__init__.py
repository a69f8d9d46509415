"""tpcompile: automatic Megatron-style tensor parallelism for PyTorch, planned on the FX graph."""

from tpcompile.api import parallelize, plan_model
from tpcompile.state.checkpoint import sharded_state_dict
from tpcompile.compile.backend import backend, parallelized
from tpcompile.errors import (
    CaptureError, CollectiveError, InputError, InputMismatchError, MeshError, PlanError,
    PlanMismatchError, RandomStateError, TPCompileError, TPCompileWarning,
)
from tpcompile.inspect.diff.diff import GraphDiff, diff
from tpcompile.compile.inductor import compile_options, mark_dynamic
from tpcompile.state.meta_init import buffers_of, init_shards, to_empty
from tpcompile.state.optim import clip_grad_norm_, grad_norm
from tpcompile.core.plan import ShardingPlan
from tpcompile.inspect.explain.explain import Report, explain
from tpcompile.runtime.module import TPModule, gather_full
from tpcompile.state.full_state import load_full_state_dict
from tpcompile.state.pretrained import from_pretrained
from tpcompile.runtime.vocab import sharded_cross_entropy
from tpcompile.runtime.blocks import fully_shard_blocks, outline_blocks

__all__ = [
    "parallelize", "plan_model", "explain", "diff", "Report", "GraphDiff", "ShardingPlan",
    "TPModule", "gather_full", "sharded_cross_entropy", "outline_blocks",
    "fully_shard_blocks",
    "backend", "parallelized", "compile_options", "mark_dynamic",
    "TPCompileError", "CaptureError", "MeshError", "PlanMismatchError", "PlanError", "InputError",
    "InputMismatchError", "RandomStateError", "CollectiveError", "TPCompileWarning",
    "load_full_state_dict", "sharded_state_dict", "from_pretrained",
    "to_empty", "init_shards", "buffers_of", "clip_grad_norm_", "grad_norm",
]
__version__ = "0.1.0"
