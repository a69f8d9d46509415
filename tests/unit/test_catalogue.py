"""The bad-input catalogue without a process group: every refusal and its exact text.

docs/guarantees.md ("The catalogue of bad inputs") quotes these messages; numerics of the entries
that are accepted are measured on gloo ranks in tests/gloo/test_reliability.py.
"""

from __future__ import annotations

import dataclasses

import operator

import pytest
import torch

import tpcompile
from tpcompile import CaptureError, InputError, PlanError
from tpcompile.tools import models
from tpcompile.api import plan_model, rewrite
from tpcompile.passes.planner.mutations import check_mutations, write_conflicts
from tpcompile.core.placement import Layout, Replicate, Shard
from tpcompile.core.plan import Conversion
from tpcompile.runtime.module import TPModule
from tpcompile.runtime.vocab import check_ids, vocab_parallel_cross_entropy, vocab_parallel_embedding
from zoo import catalogue_models as cm


def _x():
    return (torch.randn(2, 3, cm.D),)


def test_custom_autograd_function_is_refused_by_name():
    with pytest.raises(CaptureError) as e:
        plan_model(cm.CustomFunction(), _x(), 2)
    msg = str(e.value)
    assert msg.startswith("StraightThrough is a custom torch.autograd.Function (applied at ")
    assert "catalogue_models.py" in msg
    assert "drops its backward" in msg and "torch.library.custom_op with register_autograd" in msg


def test_the_custom_op_fix_is_kept_whole():
    _, plan = plan_model(cm.CustomOp(), _x(), 2)
    assert set(plan.styles().values()) == {"replicate"}  # gathered around the op, correct


@pytest.mark.parametrize("cls, attrs", [(cm.PythonCounter, "self.step"),
                                        (cm.CachesActivation, "self.last_hidden")])
def test_python_state_assigned_in_forward_is_refused_and_restored(cls, attrs):
    model = cls()
    before = dict(model.__dict__)
    with pytest.raises(CaptureError) as e:
        plan_model(model, _x(), 2)
    assert str(e.value).startswith(f"forward assigns Python state: {attrs}; the parallelized "
                                   "module runs the graph traced once")
    assert model.__dict__.keys() == before.keys()
    assert all(model.__dict__[k] is v for k, v in before.items())


@pytest.mark.parametrize("cls, attr", [(cm.LazyTable, "table"), (cm.LazyHelperTable, "tables.table")])
def test_a_cache_built_on_the_first_call_is_refused_with_its_fix(cls, attr):
    """On the module or on a plain helper object it holds (Z-Image's RopeEmbedder): refused,
    and no fake tensor left behind on the user's model."""
    model = cls()
    with pytest.raises(CaptureError) as e:
        plan_model(model, _x(), 2)
    assert str(e.value).startswith(f"forward sets self.{attr}, None before the call (a cache "
                                   "built on the first call, ")
    assert "hint: build it before parallelize" in str(e.value)
    assert operator.attrgetter(attr)(model) is None  # restored
    x = _x()
    want = model(*x)  # the fix: one call builds the table
    cap, _ = plan_model(model, x, 2)
    torch.testing.assert_close(cap.gm(*x), want, rtol=0, atol=0)


def test_a_tensor_rebound_to_itself_is_captured():
    model = cm.RebindsItself()
    table, x = model.table, _x()
    cap, _ = plan_model(model, x, 2)
    assert model.table is table
    torch.testing.assert_close(cap.gm(*x), model(*x), rtol=0, atol=0)


def test_buffers_updated_in_place_are_part_of_the_graph():
    model = cm.RunningMean()
    gm, _, _ = rewrite(model, _x(), 1, 0)
    assert "add_" in gm.code and torch.equal(model.ema, torch.zeros(cm.H))  # untouched by capture


def test_unsupported_python_on_tensors_is_a_capture_error():
    with pytest.raises(CaptureError) as e:
        plan_model(cm.ToNumpy(), _x(), 2)
    assert str(e.value).startswith("torch.export could not capture ToNumpy: ")
    assert "make forward traceable" in str(e.value)


def test_an_op_without_a_rule_is_gathered_and_listed():
    _, plan = plan_model(cm.MLP(), _x(), 2)
    assert plan.fallbacks == {}
    _, plan = plan_model(models.build("llama", n_layers=1), models.example_inputs(models.build("llama")), 2)
    assert plan.fallbacks == {}  # the gloo numerics test covers a model with a fallback


def test_world_size_larger_than_a_dim_keeps_it_whole():
    _, plan = plan_model(cm.Narrow(), _x(), 4)
    assert plan.params["fc1.weight"].reason == ("3 output features: fewer than the 4 ranks, "
                                                "nothing to split")


def test_integer_weights_are_sharded_like_float_ones():
    _, plan = plan_model(cm.Int8Weight(), _x(), 2)
    styles = plan.styles()
    assert (styles["w_q"], styles["scale"], styles["fc2.weight"]) == ("colwise", "colwise", "rowwise")


def test_in_place_ops_on_shards_stay_local():
    gm, plan, _ = rewrite(cm.InPlaceOps(), _x(), 2, 0)
    assert plan.styles()["fc1.weight"] == "colwise"
    assert "relu_" in gm.code and "mul_" in gm.code
    # the in-place residual writes into the all-reduced sum: a clone, not the collective's buffer
    assert "clone_default = torch.ops.aten.clone.default(all_reduce)" in gm.code


def test_a_write_that_would_land_on_a_copy_keeps_its_chain_replicated():
    cap, plan = plan_model(cm.SliceAssign(), _x(), 2)
    assert set(plan.styles().values()) == {"replicate"}
    conflicts = write_conflicts(cap.gm, lambda u, v: (u.name, v.name) == ("gelu", "slice_1"))
    assert [(c.op.name, c.readers) for c in conflicts] == [("fill_", ["linear_1", "mean"])]


def test_a_plan_with_such_a_write_is_refused():
    """The planner avoids these plans (above); the check on its result is the backstop."""
    cap, plan = plan_model(cm.SliceAssign(), _x(), 2)
    sharded = Shard(2, Layout("fc1.weight", cm.H))
    bad = dataclasses.replace(
        plan, placements={**plan.placements, "gelu": sharded},
        conversions=plan.conversions + (Conversion("gelu", "slice_1", sharded, Replicate()),))
    with pytest.raises(PlanError) as e:
        check_mutations(cap.gm, state=None, plan=bad)
    msg = str(e.value)
    assert msg.startswith("in-place op aten.fill_.Tensor at node fill_ (")
    assert "catalogue_models.py:" in msg and ": h[..., :2] = 0) writes into" in msg
    assert ("writes into slice_1 (a view of gelu); gelu is placed S(2) but slice_1 reads it as "
            "R, so the write would land on a copy while linear_1, mean still read the original") in msg
    assert "hint: write it out of place" in msg


def _tp(model, x):
    gm, plan, _ = rewrite(model, x, 1, 0)
    return TPModule(gm, plan, 0, None)


@pytest.mark.parametrize("call, text", [
    ((torch.randn(3, 64),), "input x: expected 3 dims like the example's float32[?, ?, 64], "
                            "got 2 dims: float32[3, 64]"),
    ((torch.randn(2, 3, 32),), "input x: dim 2 must be 64 like the example's float32[?, ?, 64] "
                               "(fixed at capture"),
    ((torch.randn(2, 3, 64, dtype=torch.float64),),
     "input x: expected dtype float32 like the example's float32[?, ?, 64], got float64[2, 3, 64]"),
    ((torch.randn(2, 3, 64), torch.randn(2, 3, 64)),
     "the call's inputs do not have the example call's structure (too many positional arguments)"),
])
def test_inputs_unlike_the_example_are_named(call, text):
    model = models.build("mlp")
    tp = _tp(model, models.example_inputs(model))
    with pytest.raises(InputError) as e:
        tp(*call)
    assert str(e.value).startswith(text)
    assert tp(torch.randn(5, 7, 64)).shape == (5, 7, 64)  # other batch and sequence sizes work


@pytest.mark.parametrize("name, seq, text", [
    ("llama", 80, "input tokens: dim 1 is 80 but the model supports at most 64 (the captured guard "
                  "tokens.size()[1] <= 64; the model slices rope_cos (64 long in dim 0) by it)"),
    ("gpt2", 65, "input idx: dim 1 is 65 but the model supports at most 64 (positions 0..63 index "
                 "the 64 rows of wpe.weight)"),
])
def test_a_size_beyond_the_models_limit_is_named_with_its_origin(name, seq, text):
    """Instead of `AssertionError: Guard failed: tokens.size()[1] <= 64` / `IndexError`."""
    model = models.build(name)
    tp = _tp(model, models.example_inputs(model))
    with pytest.raises(InputError) as e:
        tp(torch.zeros(2, seq, dtype=torch.int64))
    assert str(e.value).startswith(text + "\n  hint: the limit is the model's")
    assert tp(torch.zeros(2, 64, dtype=torch.int64)).shape == (2, 64, 128)  # the limit itself runs


@pytest.mark.parametrize("value, text", [
    (300, "input tokens: token id 300 is out of range for the embedding tok_embeddings.weight "
          "(128 rows): token ids must be in [0, 128), got values from 0 to 300"),
    (-1, "input tokens: token id -1 is out of range for the embedding tok_embeddings.weight "
         "(128 rows): token ids must be in [0, 128), got values from -1 to 127"),
])
def test_token_ids_outside_a_replicated_embedding_are_named(value, text):
    """Instead of torch's `IndexError: index out of range in self` inside the graph."""
    model = models.build("llama")
    tp = _tp(model, models.example_inputs(model))
    ids = torch.zeros(2, 16, dtype=torch.int64)
    ids[0, 1], ids[1, 2] = value, 0 if value > 0 else 127
    with pytest.raises(InputError) as e:
        tp(ids)
    assert str(e.value).startswith(text + "\n  hint: the unsharded model would raise IndexError")


def test_token_ids_outside_a_vocabulary_parallel_embedding_are_named_before_the_graph():
    """The in-graph check would raise after a peer may have entered the lookup's all-reduce."""
    ids = torch.randint(0, 16, (2, 5))
    gm, plan, _ = rewrite(cm.Embedder(vocab=16), (ids,), 2, 0, vocab_parallel=True)
    assert plan.styles()["emb.weight"] == "vocab"
    with pytest.raises(InputError) as e:
        TPModule(gm, plan, 0, None)(ids.clone().fill_(16))
    assert str(e.value).startswith("input ids: token id 16 is out of range for the embedding "
                                   "emb.weight (16 rows): token ids must be in [0, 16), got "
                                   "values from 16 to 16")


def test_keyword_inputs_are_checked_by_name():
    model = models.build("gpt2")
    ids = models.example_inputs(model)[0]
    tp = _tp(model, (ids,))
    with pytest.raises(InputError, match="input idx: expected dtype int64"):
        tp(ids.int())


def test_token_ids_outside_a_sharded_vocabulary_raise():
    w = torch.randn(4, 3)
    with pytest.raises(InputError) as e:
        vocab_parallel_embedding(w, torch.tensor([[0, 9]]), 4, 8, vocab=8)
    assert str(e.value).startswith("vocabulary-parallel embedding: token ids must be in [0, 8), "
                                   "got values from 0 to 9")
    with pytest.raises(InputError, match="cross-entropy targets: token ids must be in"):
        vocab_parallel_cross_entropy(torch.randn(2, 4), torch.tensor([1, 8]), 1, 0, 4,
                                     group="unused", vocab=8)
    rows = vocab_parallel_embedding(w, torch.tensor([[4, 7, 1]]), 4, 8, vocab=8)
    assert torch.equal(rows, torch.cat([w[[0, 3]], torch.zeros(1, 3)])[None])  # 1: another rank's
    check_ids(torch.tensor([1, -100]), 8, "targets", ignore_index=-100)  # ignored, not an id


def test_parallelize_on_its_own_result_is_refused():
    model = models.build("mlp")
    x = models.example_inputs(model)
    with pytest.raises(CaptureError, match="the model is already parallelized"):
        plan_model(_tp(model, x), x, 2)


def test_errors_are_one_family():
    for cls in (CaptureError, InputError, PlanError, tpcompile.MeshError,
                tpcompile.PlanMismatchError, tpcompile.CollectiveError, tpcompile.InputMismatchError):
        assert issubclass(cls, tpcompile.TPCompileError)
    assert issubclass(tpcompile.CollectiveError, RuntimeError)
