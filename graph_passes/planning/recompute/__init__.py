"""Recompute (Mimose, checkpointing): which forward segments drop their activations and re-run for the backward; the input-aware estimator and plan cache; the pass that writes the re-runs."""
