"""Planning: block partition and schedules here; one subpackage per technique (swap, recompute, split), each with its planner, its plan type and the pass that writes the plan into the graph."""
