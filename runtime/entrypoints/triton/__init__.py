"""Triton Inference Server: the model repository writer (`repo`), the Python-backend model (`model`, copied
into the repository) and the follower ranks of an mpiexec deployment (`follower`)."""
