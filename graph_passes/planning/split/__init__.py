"""Split (TSPLIT): per-op split rules, the cost of a split, the joint swap-and-split planner and the pass that writes micro-ops into the graph."""
