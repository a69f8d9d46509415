"""The planner's refinements, in stages, and the steps that finish a settled plan.

Each refinement is a file named after its function ``name(gm, state, constraints) ->
Decision``: what one propagation round's ``state`` shows that the ``constraints`` do not hold
yet. :func:`~tpcompile.passes.planner.plan_sharding.plan_sharding` propagates, asks the
stages of :data:`REFINEMENTS` in order, adds the first non-empty stage's decisions (merged
with ``|``: the first reason a root is killed for wins) to its constraints, and propagates
again, until no stage adds anything. Why this order:

- *demands* and the *tied tables* / *early reductions* / *cache cuts* change how propagation
  cuts roots; they settle before chains are judged, since a killed root stays killed;
- *dead chains* (and the other reasons to keep a root whole) judge every chain at once;
  *unpaid chains* last among them, so that a chain refused for what it cannot do is named
  for that, not for its cost;
- *partials joining shards* is judged once every chain stands: a shard joined in a chain
  about to be killed is no reason to keep a side chain whole;
- *partials reduced in pieces* merges reductions only of chains that stand as written, and
  *scaled partials* reduces a row-parallel output before a gate with a gradient scales it;
- *carried sums* carries sums last, on the plan as it stands.

Then :func:`~tpcompile.passes.planner.freeze.freeze` reads the settled state into the plan
(after its own ``ABSORB`` steps), and each step of :data:`FINISH`,
``name(gm, state, plan) -> ShardingPlan``, returns the plan it finishes.
"""

from __future__ import annotations

from tpcompile.passes.planner.experts.grouped import whole_grouped_experts
from tpcompile.passes.planner.experts.looped import whole_looped_experts
from tpcompile.passes.planner.mutations import check_mutations
from tpcompile.passes.planner.refine.cache_cuts import cache_cuts
from tpcompile.passes.planner.refine.carried_sums import carried_sums
from tpcompile.passes.planner.refine.dead_chains import dead_chains
from tpcompile.passes.planner.refine.decision import Decision
from tpcompile.passes.planner.refine.demands import demands
from tpcompile.passes.planner.refine.mixed_partials import mixed_partials
from tpcompile.passes.planner.refine.partials_joining_shards import partials_joining_shards
from tpcompile.passes.planner.refine.partials_reduced_in_pieces import partials_reduced_in_pieces
from tpcompile.passes.planner.refine.scaled_partials import scaled_partials
from tpcompile.passes.planner.refine.stale_ties import stale_ties
from tpcompile.passes.planner.refine.tied_tables import tied_tables
from tpcompile.passes.planner.refine.unpaid_chains import unpaid_chains
from tpcompile.passes.planner.refine.whole_grads_into_chunks import whole_grads_into_chunks
from tpcompile.passes.planner.refine.written_copies import written_copies

__all__ = ["Decision", "FINISH", "REFINEMENTS"]

# stage name -> its refinements, asked in this order; a stage's decisions merge left to right
REFINEMENTS = (
    ("demands", (demands,)),
    ("cuts", (tied_tables, mixed_partials, cache_cuts)),
    ("chains", (dead_chains, written_copies, stale_ties, whole_grads_into_chunks,
                 unpaid_chains)),
    ("joins", (partials_joining_shards,)),
    ("pieces", (partials_reduced_in_pieces, scaled_partials)),
    ("carried", (carried_sums,)),
)

# after freeze, in order: each returns the plan it was given, finished (or raises)
FINISH = (whole_grouped_experts, whole_looped_experts, check_mutations)
