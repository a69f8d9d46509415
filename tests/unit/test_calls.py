"""The call agreement's pieces without a process group: descriptions, messages, modes.

The agreement itself (the all-reduce on the gloo side group, every mode against every
perturbation) runs on gloo ranks in tests/gloo/test_chaos.py.
"""

from __future__ import annotations

import pytest
import torch

from tpcompile.runtime.calls import CallCheck, _digest, _message, describe


def test_a_call_is_described_by_dtypes_shapes_other_arguments_and_grad_mode():
    ids = torch.zeros(2, 16, dtype=torch.int64)
    assert describe((ids,), {}) == "(int64[2, 16]), grad"
    with torch.no_grad():
        assert describe((ids, 3), {"mask": torch.ones(2, 16, dtype=torch.bool)}) == \
            "(int64[2, 16], 3, mask=bool[2, 16]), no grad"
    assert _digest("a") != _digest("b") and min(_digest("a"), _digest("b")) > 0  # 0: refused


def test_the_mismatch_message_groups_ranks_that_agree():
    m = _message([("(int64[2, 16]), grad", None)] * 3 + [("(int64[2, 24]), grad", None)])
    assert m.startswith("ranks called the module with different inputs (dtypes and shapes, "
                        "grad mode):\n  ranks [0, 1, 2]: (int64[2, 16]), grad\n"
                        "  rank 3: (int64[2, 24]), grad\n  hint: every rank")


def test_a_refusal_is_named_before_any_difference():
    m = _message([("a", None), ("b", "InputError: input tokens: token id 9 is out of range")])
    assert m == ("rank 1 refused its inputs (InputError: input tokens: token id 9 is out of "
                 "range); every rank stops here instead of issuing the model's collectives")


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"check_calls must be one of \('new', 'every'\), got 'all'"):
        CallCheck(None, "all")
