"""The call agreement's pieces without a process group: descriptions, messages, modes.

The agreement itself (the all-reduce on the gloo side group, every mode against every
perturbation) runs on gloo ranks in tests/gloo/test_chaos.py.
"""

from __future__ import annotations

import pytest
import torch

from tpcompile.runtime.calls import CallCheck, _digest, _message, describe, values_digest


def test_a_call_is_described_by_dtypes_shapes_other_arguments_and_grad_mode():
    ids = torch.zeros(2, 16, dtype=torch.int64)
    assert describe((ids,), {}) == "(int64[2, 16]), grad"
    with torch.no_grad():
        assert describe((ids, 3), {"mask": torch.ones(2, 16, dtype=torch.bool)}) == \
            "(int64[2, 16], 3, mask=bool[2, 16]), no grad"
    assert _digest("a") != _digest("b") and min(_digest("a"), _digest("b")) > 0  # 0: refused


def test_the_mismatch_message_groups_ranks_that_agree():
    m = _message([("(int64[2, 16]), grad", None, "1/2")] * 3
                 + [("(int64[2, 24]), grad", None, "3/4")])
    assert m.startswith("ranks called the module with different inputs (dtypes and shapes, "
                        "grad mode):\n  ranks [0, 1, 2]: (int64[2, 16]), grad\n"
                        "  rank 3: (int64[2, 24]), grad\n  hint: every rank")


def test_a_refusal_is_named_before_any_difference():
    m = _message([("a", None, "1/2"),
                  ("b", "InputError: input tokens: token id 9 is out of range", "")])
    assert m == ("rank 1 refused its inputs (InputError: input tokens: token id 9 is out of "
                 "range); every rank stops here instead of issuing the model's collectives")


def test_same_shapes_with_other_values_name_the_input_and_the_ranks():
    ids, mask = torch.arange(32).reshape(2, 16), torch.ones(2, 16, dtype=torch.bool)
    names = ["tokens", "mask"]
    mine = values_digest(names, [ids, mask])
    other = values_digest(names, [ids.flip(-1), mask])
    assert mine == values_digest(names, [ids.clone(), mask.clone()])
    assert mine[0] != other[0] and mine[1] == other[1]  # order counts too
    m = _message([("(int64[2, 16], bool[2, 16]), grad", None, mine)] * 2
                 + [("(int64[2, 16], bool[2, 16]), grad", None, other)])
    assert m.startswith("ranks called the module with the same shapes ((int64[2, 16], "
                        "bool[2, 16]), grad) but different values of input tokens (every input "
                        "tensor is compared: token ids, positions, masks, features; per tensor: "
                        f"sum / position-weighted sum):\n  input tokens:\n    ranks [0, 1]: "
                        f"{mine[0][1]}\n    rank 2: {other[0][1]}\n  hint: every rank"), m



def test_float_inputs_are_compared_unless_left_out():
    """Floats too; ``floats=False`` (a pipeline's shape inference) leaves them out."""
    ids, x = torch.arange(6).reshape(2, 3), torch.randn(2, 3)
    mine = values_digest(["x", "ids"], [x, ids])
    assert mine == values_digest(["x", "ids"], [x.clone(), ids])
    assert mine[0] != values_digest(["x", "ids"], [x + 1e-6, ids])[0]  # a tiny change
    assert mine[0] != values_digest(["x", "ids"], [x.flip(-1), ids])[0]  # order counts
    assert values_digest(["x", "ids"], [x, ids], floats=False) == \
        values_digest(["x", "ids"], [x + 1, ids], floats=False) == mine[1:]


def test_a_call_from_pipeline_shape_inference_is_recognised():
    """The frame names torch.distributed.pipelining's stage uses for its metadata inference."""
    from torch.distributed.pipelining.stage import PipelineStage
    from tpcompile.runtime.calls import _SHAPE_INFERENCE, _in_pipeline_shape_inference

    assert _SHAPE_INFERENCE & {name for cls in PipelineStage.__mro__ for name in vars(cls)}
    assert not _in_pipeline_shape_inference()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"check_calls must be one of \('new', 'every'\), got 'all'"):
        CallCheck(None, "all")
