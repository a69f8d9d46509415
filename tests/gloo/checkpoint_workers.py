"""Rank-side bodies of ``test_checkpointing.py``: activation checkpointing kept on the shards.

Each case returns plain data: the errors against the unsharded model (outputs, every
gradient), the regions the parallelized model checkpoints, the warnings ``parallelize`` gave,
and the bytes autograd saves for backward (``saved_activation_bytes``).
"""

from __future__ import annotations

import copy
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import tpcompile
from tpcompile.tools import models
from tpcompile.tools.numerics import compare, grad_errors, rel_err, saved_activation_bytes


class CheckpointedLlama(models.Llama):
    """The built-in Llama with each layer run through ``torch.utils.checkpoint``."""

    def __init__(self, cfg: models.ModelConfig, use_reentrant: bool):
        super().__init__(cfg)
        self.use_reentrant = use_reentrant

    def forward(self, tokens):
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=self.use_reentrant)
        return self.output(self.norm(x))


class CheckpointedMLP(models.MLPStack):
    """Residual MLP blocks, each through ``torch.utils.checkpoint`` (the memory cases)."""

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


LLAMA = models.ModelConfig(bias=False, n_layers=2)
MLP = models.ModelConfig(dim=64, hidden=256, n_layers=4)


def _model(name: str):
    """(model, inputs, parallelize options) of case ``name``."""
    torch.manual_seed(0)
    plain = name.endswith(("_full", "_selective", "_plain"))  # does not checkpoint itself
    if name.startswith("llama"):
        model = models.Llama(LLAMA) if plain else CheckpointedLlama(LLAMA, "reentrant" in name)
        return model, models.example_inputs(model), _options(name)
    if name.startswith("mlp"):
        model = models.MLPStack(MLP) if plain else CheckpointedMLP(MLP)
        return model, models.example_inputs(model, batch=4, seq=32), _options(name)
    model = hf_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {}


def _options(name: str) -> dict:
    mode = name.rpartition("_")[2]
    return {"activation_checkpointing": mode} if mode in ("full", "selective") else {}


def hf_llama():
    """A tiny random-init transformers Llama in training mode with gradient checkpointing."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg)
    with warnings.catch_warnings():  # transformers' note that the name is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()  # use_reentrant=False, transformers' default
    return model.train()


def _parallelized(model, inputs, **options):
    """``(parallelize(model, inputs, **options), the tpcompile warnings it gave)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp = tpcompile.parallelize(model, inputs, **options)
    return tp, [str(w.message) for w in caught if "tpcompile" in str(w.message)]


def _case(name: str) -> dict:
    """``name``; ``name:compiled``: the TPModule through torch.compile(fullgraph=True);
    ``name:backend``: the model through torch.compile(backend="tpcompile"); ``name:mesh``:
    on a (dp 2, tp 2) mesh with FSDP2 (:func:`_mesh_case`)."""
    name, _, variant = name.partition(":")
    if variant == "mesh":
        return _mesh_case(name)
    model, inputs, options = _model(name)
    if variant == "backend":
        step, tp, warned = _by_backend(model, inputs)
    else:
        tp, warned = _parallelized(model, inputs, **options)
        step = torch.compile(tp, fullgraph=True, options=tpcompile.compile_options()) \
            if variant == "compiled" else tp
    result = compare(model, step, inputs)
    return {"output_err": result.output_err, "grad_errs": result.grad_errs,
            "regions": tp.checkpointed_regions, "warnings": warned,
            # compiled: the tensors the compiled forward hands its backward (the partitioned
            # backward graph's saved inputs), which saved_tensors_hooks see
            "saved": saved_activation_bytes(step, inputs),
            "saved_unsharded": saved_activation_bytes(model, inputs),
            # eager only: a compiled backward runs higher-order ops the counter cannot see into
            "backward_ops": backward_ops(tp, inputs) if variant == "" else None,
            "block_inputs": _block_input_bytes(model, inputs)}


def _by_backend(model, inputs):
    """``(compiled step, its TPModule, warnings)`` of torch.compile(copy of model,
    backend="tpcompile") after its first call (which parallelizes)."""
    from support import workers

    compiled = copy.deepcopy(model)
    step = torch.compile(compiled, backend="tpcompile")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(*inputs)
    compiled.zero_grad()
    tp = tpcompile.parallelized(compiled)
    return workers.BackendView(step, compiled), tp, [
        str(w.message) for w in caught if "tpcompile" in str(w.message)]


def _mesh_case(name: str) -> dict:
    """``name`` on a (dp 2, tp 2) mesh: tensor parallel over "tp", then FSDP2 on each block
    and the root over "dp" (``fully_shard_blocks``); each dp rank runs half the batch. FSDP2
    averages the dp ranks' gradients, so the reference's loss is the mean of the halves'."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    k = mesh["dp"].get_local_rank()
    model, inputs, options = _model(name)
    inputs = models.example_inputs(model, batch=4, seq=inputs[0].shape[1])  # 2 per dp rank
    reference = copy.deepcopy(model)
    local = tuple(x.chunk(2)[k] for x in inputs)
    tp, warned = _parallelized(model, local, mesh=mesh["tp"], **options)
    tpcompile.fully_shard_blocks(tp, mesh["dp"])
    want, got = reference(*inputs), tp(*local)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(1234))
    (want * probe).sum().div(2).backward()
    (got * probe.chunk(2)[k]).sum().backward()
    grads = tp.full_grads()
    return {"output_err": rel_err(got, want.chunk(2)[k]),
            "grad_errs": grad_errors(grads, {n: p.grad for n, p in reference.named_parameters()}),
            "regions": tp.checkpointed_regions, "warnings": warned,
            "saved": saved_activation_bytes(tp, local),
            "saved_unsharded": saved_activation_bytes(model, inputs),
            "block_inputs": _block_input_bytes(model, local)}


class _OpCounter(TorchDispatchMode):
    """Counts the matmuls and collectives that reach the dispatcher (a selective
    checkpoint's saved outputs are served before they do)."""

    def __init__(self):
        super().__init__()
        self.counts = {"mm": 0, "collectives": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.counts["mm"] += 1
        elif func.namespace == "_c10d_functional" and func.__name__ != "wait_tensor.default":
            self.counts["collectives"] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(tp, inputs) -> dict:
    """Matmuls and collectives run by one backward (recomputations included)."""
    out = tp(*inputs)
    out = out if isinstance(out, torch.Tensor) else out[0]  # a Hugging Face model's logits
    with _OpCounter() as counter:
        out.float().sum().backward()
    tp.zero_grad()
    return counter.counts


def _block_input_bytes(model, inputs) -> int:
    """The bytes of every block's (batch, seq, dim) float32 input: what each rank keeps whole
    for backward once the blocks are checkpointed (the activations between blocks are
    replicated in tensor parallelism without sequence parallelism)."""
    cfg = getattr(model, "cfg", None) or model.config
    layers = getattr(cfg, "n_layers", None) or cfg.num_hidden_layers
    dim = getattr(cfg, "dim", None) or cfg.hidden_size
    return inputs[0].shape[0] * inputs[0].shape[1] * dim * 4 * layers


def checkpointed(rank: int, world_size: int, names: list[str]) -> dict:
    out = {}
    for name in names:
        torch.compiler.reset()
        try:
            out[name] = _case(name)
        except Exception:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": traceback.format_exc()}
    return out
