"""The ``advise`` command: how to split a model over a number of GPUs (advise.py), its text
(advise_text), the expert-parallel rows (advise_experts), the step measured on meta tensors
(advise_measure), and the cost model and retained-memory count its estimates come from
(costs, retained; ``tpcompile/tools/numerics.py`` reads retained too).

The package exports the command, so ``tpcompile.inspect.advise.advise(...)`` keeps working.
"""

from tpcompile.inspect.advise.advise import SCHEMA, Advice, Estimate, advise

__all__ = ["Estimate", "Advice", "advise", "SCHEMA"]
