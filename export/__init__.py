"""The build: a recipe in, an engine directory out. `plan/` (what fits: parameters, memory, the dp decode model),
`convert/` (reading a checkpoint, synthetic checkpoints, model-aware quantization of one rank's weights), `build/`
(the driver, its stages, content keys, records and publishing) and `backends/` (what each backend makes of a
converted rank: its graph form and its lowering). `checkpoint` and `synth` here are aliases of their `convert/`
modules."""
