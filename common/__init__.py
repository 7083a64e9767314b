"""moe_export.common: the foundation every other package may use and which imports none of them.

errors (the error hierarchy), mpi (the MPI world, local rank -> device, communicators), atomic (atomic writes,
content hashes), mapping (one rank's place in the tp/ep/dp world), recipe (the recipe schema), model_config (the
checkpoint's HF config), engine_config and manifest (the engine directory's contract: config.json, manifest.json,
file names and formats).
"""
