"""Graph analyses, planners and passes over training-step graphs.

``training_graph`` holds the graph plus the role of every value; ``shapes``, ``liveness`` and
``memory`` are the analyses every planner and the runtime share; ``blocks`` cuts a schedule into
execution blocks. Passes (one per file) arrive with the swap, recompute and split issues.
"""
