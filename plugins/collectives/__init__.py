"""Collective nodes of the per-rank graphs: `AllReduce` (sum) and `AllGather` over the tp or ep group."""
