"""Rank bodies for test_never_silent.py: every entry point over every kind of model.

A cell builds one model source, runs it through one entry point on this rank and ends in one
of two outcomes: ``ran`` (sharded, its errors against the unsharded model, the tokens
``generate`` gave) or ``refused`` (a ``TPCompileError``: its type and message). Anything else
(another exception, a run that shards nothing) is reported as it is, for the test to fail on.
Compiled cells use AOTAutograd's eager backend in place of inductor, whose code generation
tests/gloo/test_compile.py covers on the built-in models: what is checked here is what each
entry point decides, not the kernels.
"""

from __future__ import annotations

import copy
import tempfile
import traceback
import warnings

import torch
from torch import nn

import tpcompile
from tpcompile.compile.backend import TPCompileBackend
from tpcompile.tools import models
from tpcompile.tools.numerics import compare, rel_err
from zoo import lora_models
from zoo.hf_models import hf_causal_lm, hf_inputs, hf_model

TOKENS = 4  # new tokens each generate cell compares


def _tiny_t5():
    import transformers as tf

    torch.manual_seed(0)  # the default config: use_cache on, the decoder with its own config
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0))


def _tiny_vit():
    import transformers as tf

    torch.manual_seed(0)
    return tf.ViTModel(tf.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=16, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        add_pooling_layer=False)


def _torchao_int8(model: nn.Module) -> nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    def block_linear(module, fqn):
        return isinstance(module, nn.Linear) and ".layers." in f".{fqn}"

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=block_linear)
    return model.requires_grad_(False).eval()


def source(name: str) -> tuple[nn.Module, tuple, dict]:
    """(model, positional inputs, keyword inputs) of a model source."""
    if name == "builtin":
        model = models.build("llama", n_layers=1, dim=32, hidden=64, n_heads=4, n_kv_heads=2)
        return model, models.example_inputs(model, 2, 8), {}
    if name in ("hf_decoder", "quantized"):
        model = hf_causal_lm("qwen3").eval()  # its forward is wrapped in transformers' decorators
        ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        return (_torchao_int8(model) if name == "quantized" else model), (ids,), {}
    if name == "hf_encoder":
        model = hf_model("bert_model").eval()
        ids, kw = hf_inputs(model)
        return model, (ids,), kw
    if name == "hf_encdec":
        model = _tiny_t5().eval()
        g = torch.Generator().manual_seed(1)
        ids, dec = torch.randint(1, 128, (2, 8), generator=g), torch.randint(1, 128, (2, 5), generator=g)
        return model, (ids,), {"decoder_input_ids": dec}
    if name == "hf_vision":
        return _tiny_vit().eval(), (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),), {}
    assert name == "lora", name
    model, inputs, kwargs, _ = lora_models.build("peft_qv")
    return model, inputs, kwargs


def _trainable(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def _sharded(tp) -> bool:
    return any(list(p.local_shapes[tp.rank]) != list(p.global_shape)
               for p in tp.plan.params.values())


def _errors(model: nn.Module, run, inputs: tuple, kwargs: dict) -> dict:
    """Outputs and, for a trainable model, every gradient against the unsharded ``model``."""
    if _trainable(model):
        result = compare(model, run, inputs, kwargs=kwargs)
        return {"output_err": result.output_err, "grad_err": result.max_grad_err}
    with torch.no_grad():
        out, ref = run(*inputs, **kwargs), model(*inputs, **kwargs)
    return {"output_err": rel_err(_tensor(out), _tensor(ref)), "grad_err": None}


def _tensor(out) -> torch.Tensor:
    from torch.utils._pytree import tree_leaves

    return next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


class _Compiled:
    """A compiled module called by ``compare``; the rest (full_grads, graph_module) is the
    TPModule's."""

    def __init__(self, step, tp_of):
        self.step, self.tp_of = step, tp_of

    def __call__(self, *args, **kwargs):
        return self.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tp_of(), name)


class AotEagerBackend(TPCompileBackend):
    """The tpcompile backend, compiling with AOTAutograd's eager backend instead of inductor."""

    def _inductor(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)


def eager(model, inputs, kwargs) -> dict:
    """parallelize, and explain's verdict on the same plan against Megatron's bound."""
    from tpcompile.inspect.traffic import bound_verdict

    tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs or None)
    report = tpcompile.explain(model, inputs, tp.plan.world_size, example_kwargs=kwargs or None)
    return {"sharded": _sharded(tp), "verdict": bound_verdict(report.megatron),
            **_errors(model, tp, inputs, kwargs)}


def compiled(model, inputs, kwargs) -> dict:
    tp = tpcompile.parallelize(model, inputs, example_kwargs=kwargs or None)
    step = torch.compile(tp, backend="aot_eager")
    return {"sharded": _sharded(tp), **_errors(model, _Compiled(step, lambda: tp), inputs, kwargs)}


def backend(model, inputs, kwargs) -> dict:
    """The backend on the model itself: the first call (the whole graph on gathered shards),
    then the retraced TPModule's, each against the unsharded model."""
    reference, compiler = copy.deepcopy(model), AotEagerBackend()
    step = _Compiled(torch.compile(model, backend=compiler), lambda: tpcompile.parallelized(model))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first = _errors(reference, step, inputs, kwargs)
    tp = tpcompile.parallelized(model)
    if tp is None:  # a silent pass-through unless the backend said why
        reasons = [str(r) for r in compiler.report] + [str(w.message) for w in said]
        return {"sharded": False, "unsharded_because": reasons, **first}
    tp.zero_grad()
    second = _errors(reference, step, inputs, kwargs)
    return {"sharded": _sharded(tp), "output_err": max(first["output_err"], second["output_err"]),
            "grad_err": None if first["grad_err"] is None else max(first["grad_err"], second["grad_err"])}


def pretrained(model, inputs, kwargs) -> dict:
    """save_pretrained -> tpcompile.from_pretrained -> generate, against model.generate."""
    import shutil

    import torch.distributed as dist

    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)  # transformers saves on the main process only
    if dist.get_rank() == 0:
        model.save_pretrained(where[0])
    dist.barrier()
    try:
        tp = tpcompile.from_pretrained(where[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where[0])
    prompt = inputs[0]
    new = dict(max_new_tokens=TOKENS, do_sample=False)
    tokens = tp.generate(prompt, **new)
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), **new)
    return {"sharded": _sharded(tp), "tokens_equal": torch.equal(tokens, want),
            "output_err": 0.0, "grad_err": None}


ENTRIES = {"eager": eager, "compiled": compiled, "backend": backend, "pretrained": pretrained}


def cells(rank: int, world_size: int, todo: list[tuple[str, str]]) -> dict:
    out = {}
    for entry, name in todo:
        try:
            model, inputs, kwargs = source(name)
            out[(entry, name)] = ENTRIES[entry](model, inputs, kwargs)
        except tpcompile.TPCompileError as e:
            out[(entry, name)] = {"refused": type(e).__name__, "message": str(e)}
        except Exception:  # noqa: BLE001 - the third outcome: the test fails on it
            out[(entry, name)] = {"error": traceback.format_exc()}
    return out
