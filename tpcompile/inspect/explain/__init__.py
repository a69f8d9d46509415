"""The ``explain`` command: the plan report (explain.py), its text and HTML renderings and the
per-block drawing (explain_text, explain_html, plan_block, plan_svg), and what only the report
reads: DTensor's equivalent plan, the experts' measured load and the collectives a
checkpointed region's recompute issues again (dtensor_plan, expert_load, recompute).

The package exports the command, so ``from tpcompile.inspect.explain import explain`` keeps
working; ``tpcompile.explain`` is the same function.
"""

from tpcompile.inspect.explain.explain import SCHEMA, ParamEntry, Report, explain

__all__ = ["ParamEntry", "Report", "explain", "SCHEMA"]
