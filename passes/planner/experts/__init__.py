"""Expert parallelism in the planner: how a mixture-of-experts block's weights are cut.

``PlanOptions.experts`` asks for each expert split column -> row (``"tensor"``), whole experts
per rank (``"expert"``), or the cheaper of the two (``"auto"``). Three shapes of MoE code, one
module each, and the cost model they share:

- ``placement``: stacked expert weights (``bmm`` / ``einsum`` over an expert dim) start their
  column root on the expert dim during propagation; grouped matmuls record which cut is asked;
  what was chosen is frozen per MoE module into ``ShardingPlan.experts``;
- ``grouped``: a finishing step that moves a grouped-matmul chain planned column -> row onto
  its experts (transformers' MoEs);
- ``looped``: a finishing step that hands each expert of a ``ModuleList`` loop whole to a rank;
- ``cost``: ``experts="auto"``'s model of both cuts, at the rates of the planner's device table
  (:mod:`tpcompile.passes.planner.devices`).

What runs at execution time lives in the layers that run it: the rows a rank's grouped matmul
multiplies (:mod:`tpcompile.runtime.routed_rows`), the placeholders of experts another rank
owns (``passes/rewrite/drop_unowned_experts.py``), and ``advise``'s views
(:mod:`tpcompile.inspect.advise.advise_experts`, :mod:`tpcompile.inspect.explain.expert_load`).
"""
