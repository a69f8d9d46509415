"""The README's pipeline table and docs/design.md's pipeline, planner and layout are generated,
not written: this test regenerates them (docs/generate.py) and compares. After adding, moving
or renaming a pass, a refinement or a module, or editing the first sentence of its docstring, run

    python docs/generate.py

and commit the docs with the new maps (the diff shows what changed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tpcompile.passes import pipeline

_PATH = Path(__file__).resolve().parents[2] / "docs" / "generate.py"
_spec = importlib.util.spec_from_file_location("tpcompile_docs_generate", _PATH)
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)


def test_the_generated_maps_are_up_to_date():
    assert generate.stale() == [], "run `python docs/generate.py` and commit the docs"


def test_every_step_of_the_pipeline_is_in_the_readme_table():
    readme = (generate.ROOT / "README.md").read_text()
    for name, _ in pipeline.steps():
        assert f"| `{name}` |" in readme


def test_every_pass_is_a_file_named_after_it_in_its_phase():
    phases = {"prepare": pipeline.PREPARE_PASSES + [p[:2] for p in pipeline.REPLAN_PASSES],
              "rewrite": [p[:2] for p in pipeline.REWRITE_PASSES + pipeline.OUTLINE_PASSES]}
    for phase, passes in phases.items():
        for name, fn in passes:
            assert fn.__name__ == f"{name}_pass"
            assert fn.__module__ == f"tpcompile.passes.{phase}.{name}", fn.__module__


def test_every_refinement_is_a_file_named_after_it_listed_once():
    from tpcompile.passes.planner import refine

    listed = [fn for _, stage in refine.REFINEMENTS for fn in stage]
    assert len({fn.__name__ for fn in listed}) == len(listed), "a refinement listed twice"
    for fn in listed:
        assert fn.__module__ == f"tpcompile.passes.planner.refine.{fn.__name__}", fn.__module__
    files = {p.stem for p in Path(refine.__file__).parent.glob("*.py")} - {"__init__", "decision"}
    assert files == {fn.__name__ for fn in listed}, "a file in refine/ that REFINEMENTS lacks"
    assert len({name for name, _ in refine.REFINEMENTS}) == len(refine.REFINEMENTS)
