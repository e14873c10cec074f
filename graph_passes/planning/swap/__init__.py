"""Swap (SwapAdvisor, DeepUM): what leaves the device arena, when, and when it comes back; the search over block sizes and state placement; the pass that writes SwapOut/SwapIn nodes."""
