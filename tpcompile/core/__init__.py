"""Layer 1, capture: the model as an ATen FX graph, and the plan's data types (placements, ShardingPlan)."""
