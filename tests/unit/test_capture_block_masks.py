"""Flex attention captured: a ``BlockMask`` input, a mask built in forward, CPU gradients.

The mask's block tensors and the tensors its ``mask_mod`` closes over are inputs of the graph
(a later call's mask is read, not the capture's); the ``flex_attention`` call is kept whole as
the higher-order op, whose dense backward runs on CPU and equals attention written out in
plain tensor ops. Sharding and numerics on gloo ranks: tests/gloo/test_flex_attention.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tpcompile
from tpcompile import CaptureError
from tpcompile.core.capture import capture
from tpcompile.tools.numerics import rel_err
from zoo import flex_models

FLEX = torch.ops.higher_order.flex_attention


def _inputs(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def test_block_mask_input_is_captured_as_graph_inputs():
    model, (x, mask) = flex_models.build("flex_alibi")
    cap = capture(model, (x, mask))
    names = [n.name for n in _inputs(cap.gm)]
    assert names[0] == "x" and len(names) == 1 + sum(
        getattr(mask, a) is not None for a in mask._TENSOR_ATTRS), names
    assert [n.target for n in cap.gm.graph.nodes if n.op == "call_function"].count(FLEX) == 1
    assert not cap.notes, cap.notes  # nothing specialised, no inference-only verdict
    reference, _ = flex_models.build("flex_alibi", math_impl=True)
    with torch.no_grad():
        torch.testing.assert_close(cap.gm(x, mask), reference(x, mask), rtol=1e-5, atol=1e-6)


class DocumentMasked(nn.Module):
    """torchtitan's document masking: the mask_mod closes over each token's document id."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, block_mask):
        q = self.proj(x).view(1, 16, 2, 4).transpose(1, 2)
        return flex_attention(q, q, q, block_mask=block_mask)


def _document_mask(ids):
    def same_document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return create_block_mask(same_document, None, None, 16, 16, device="cpu")


def test_a_mask_mods_closure_tensors_are_inputs_read_at_each_call():
    model = DocumentMasked()
    x = torch.randn(1, 16, 8)
    first, second = torch.tensor([0] * 8 + [1] * 8), torch.tensor([0] * 4 + [1] * 12)
    cap = capture(model, (x, _document_mask(first)))
    assert len(_inputs(cap.gm)) == 1 + 8 + 1  # x, the block tensors, the document ids
    with torch.no_grad():
        torch.testing.assert_close(cap.gm(x, _document_mask(second)),
                                   model(x, _document_mask(second)))
        assert not torch.allclose(cap.gm(x, _document_mask(second)),
                                  cap.gm(x, _document_mask(first)))


def test_mask_built_in_forward_is_captured():
    model, (x,) = flex_models.build("flex_inner_mask")
    cap = capture(model, (x,))
    reference, _ = flex_models.build("flex_inner_mask", math_impl=True)
    with torch.no_grad():
        torch.testing.assert_close(cap.gm(x), reference(x), rtol=1e-5, atol=1e-6)


def test_captured_flex_attention_differentiates_on_cpu():
    """torch refuses ``flex_attention`` on CPU inputs that require grad; the captured graph
    calls the higher-order op, whose backward runs, and equals the written-out attention's."""
    model, (x, mask) = flex_models.build("flex_slope_table")
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        model(x, mask)
    cap = capture(model, (x, mask))
    assert not cap.inference_only
    reference, _ = flex_models.build("flex_slope_table", math_impl=True)
    cap.gm(x, mask).square().sum().backward()
    reference(x, mask).square().sum().backward()
    got = dict(cap.gm.named_parameters())
    errors = {name: rel_err(got[name].grad, p.grad) for name, p in reference.named_parameters()}
    assert len(errors) == 5 and max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("name,world_size,whole", [
    ("flex_alibi", 2, set()), ("flex_alibi_gqa", 4, set()),
    ("flex_alibi_mqa", 4, {"k.weight", "v.weight"})])
def test_flex_attention_is_planned_by_heads(name, world_size, whole):
    model, inputs = flex_models.build(name)
    report = tpcompile.explain(model, inputs, world_size)
    styles = {p: report.params[p].style for p in ("q.weight", "k.weight", "v.weight",
                                                  "o.weight")}
    expected = {"q.weight": "colwise", "k.weight": "colwise", "v.weight": "colwise",
                "o.weight": "rowwise"}
    assert styles == {p: "replicate" if p in whole else s for p, s in expected.items()}
    assert not report.fallbacks, report.fallbacks


def test_hugging_face_flex_attention_captured_at_the_example_sizes():
    """transformers builds the block mask in forward; with dynamic sizes export fails (and
    spoils a second attempt), so the capture is static and says so. A padding mask is refused
    at transformers' own data-dependent check, by name."""
    pytest.importorskip("transformers")
    model, (ids,) = flex_models.build("hf_llama_flex")
    with pytest.warns(UserWarning, match="attn_implementation='flex_attention'"):
        cap = capture(model, (ids,))
    assert any("accepts only the example's sizes" in note for note in cap.notes), cap.notes
    with torch.no_grad():
        torch.testing.assert_close(cap.gm(ids)[0], model(ids).logits)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    with pytest.raises(CaptureError, match="masking_utils.py"):
        capture(model, (ids,), {"attention_mask": mask})
