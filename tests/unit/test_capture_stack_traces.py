"""Capture records FX stack traces only where an error message needs them (it is a sixth of
export's time on a large model), and its ``Function.apply`` recording leaves torch as it was."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch

from tpcompile import CaptureError
from tpcompile.tools import models
from tpcompile.core.capture import capture
from tpcompile.core.capture_checks import custom_function_calls
from zoo import catalogue_models as cm


def _x():
    return (torch.randn(2, 3, cm.D),)


def test_models_without_in_place_ops_are_captured_without_stack_traces():
    model = models.build("llama")
    cap = capture(model, models.example_inputs(model, 2, 8))
    traced = {n.target for n in cap.gm.graph.nodes if n.meta.get("stack_trace")}
    assert traced <= {torch.ops.aten.sym_size.int}  # export's own input-size nodes only
    assert not getattr(torch.fx.config, "do_not_emit_stack_traces", False)  # restored (2.13+)


def test_models_with_in_place_ops_keep_stack_traces_for_their_error_messages():
    cap = capture(cm.SliceAssign(), _x())
    fills = [n for n in cap.gm.graph.nodes if "fill_" in str(n.target)]
    assert fills and all("h[..., :2] = 0" in n.meta["stack_trace"] for n in fills)


def test_function_apply_is_restored_after_a_refused_capture():
    original = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(CaptureError):
        capture(cm.CustomFunction(), _x())
    assert torch.autograd.Function.__dict__["apply"] is original
    x = torch.randn(3, requires_grad=True)
    cm.StraightThrough.apply(x).sum().backward()  # the Function's own backward still runs
    assert torch.equal(x.grad, torch.ones(3))


def test_functions_applied_by_other_threads_are_not_recorded():
    x = torch.randn(3)
    with custom_function_calls() as calls:
        worker = threading.Thread(target=lambda: cm.StraightThrough.apply(x))
        worker.start()
        worker.join()
        assert calls == []
        line = inspect.currentframe().f_lineno + 1
        cm.StraightThrough.apply(x)
    assert calls == [("StraightThrough", f"{__file__}:{line}")]


def _exports_counted(monkeypatch) -> list:
    calls, export = [], torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or export(*a, **k))
    return calls


def test_in_place_ops_found_after_the_export_cost_a_second_export(monkeypatch):
    calls = _exports_counted(monkeypatch)
    capture(cm.SliceAssign(), _x())
    assert len(calls) == 2  # the first graph shows the writes; exported again with model lines


def test_a_module_that_declares_its_in_place_writes_is_exported_once(monkeypatch):
    # the static-cache wrapper generate captures declares its cache writes
    from tpcompile.core.capture import IN_PLACE
    from tpcompile.runtime.static_cache import StaticCacheLM

    assert getattr(StaticCacheLM, IN_PLACE)
    model = cm.SliceAssign()
    setattr(model, IN_PLACE, True)
    calls = _exports_counted(monkeypatch)
    cap = capture(model, _x())
    fills = [n for n in cap.gm.graph.nodes if "fill_" in str(n.target)]
    assert len(calls) == 1
    assert fills and all("h[..., :2] = 0" in n.meta["stack_trace"] for n in fills)
