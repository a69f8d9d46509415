"""The planner: the op rule table, placement propagation, and the ShardingPlan it freezes."""
