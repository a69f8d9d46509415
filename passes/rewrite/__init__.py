"""The rewrite passes: turn the captured graph into one rank's graph under a ShardingPlan."""
