"""Dynamic networks (DyNN-Offload): block-wise export, the block-wise runtime with residency and prefetch, the misprediction cache, the pilot glue and the block-wise trainer."""
