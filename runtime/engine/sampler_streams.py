"""The constants of the random streams the host sampler (`sampler`) and its kernel (`sampler_kernels`) both draw
from: equal draws on both sides depend on them (a module of its own so that neither imports the other)."""

_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
BLOCK = 1024  # tokens per block of a proposal's draw (the kernel's step): the draws depend on it
PROPOSALS = 8  # tokens proposed per pass over a row
ROUNDS = 32  # passes over a row at most
STREAM_BLOCKS = 1 << 24  # blocks per (pass, proposal) in the uniform streams: vocabularies up to 2^34
