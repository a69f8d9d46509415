"""The prepare passes: normalise the captured graph into the form the planner reads."""
