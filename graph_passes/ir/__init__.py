"""The graph and program IR the planners work on: training-step graphs, shapes, liveness, the lowered program of blocks and memory steps, and the best-fit allocator that replays it."""
