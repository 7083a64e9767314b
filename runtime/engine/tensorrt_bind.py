"""Binding a step's tensors to a TensorRT execution context, checked against the engine's optimization profile
(shared by the rank engine, `tensorrt.py`, and the vision tower, `tensorrt_vision.py`)."""

from __future__ import annotations

import math

from moe_export.common.errors import InputError


def check_shape(meta: dict, name: str, shape: tuple[int, ...]) -> None:
    """InputError when `shape` of input `name` lies outside the engine's optimization profile."""
    low, _, high = meta["profile"][name]
    bad = [(axis, d, lo, hi) for axis, (d, lo, hi) in enumerate(zip(shape, low, high)) if not lo <= d <= hi]
    if len(shape) != len(low) or bad:
        raise InputError(f"input {name} shape {list(shape)} is outside the engine's profile {low}..{high} "
                         f"(axis, value, min, max: {bad}); the step exceeds the built limits")


def bind(context, meta: dict, inputs: dict, outputs: dict, empty_address: int = 0) -> None:
    """Set every input's shape and every tensor's address on `context` (tensors with .shape and .data_ptr()),
    checking each return value (TensorRT reports refusal by returning False, it never raises). A tensor of no
    elements (torch gives it address 0) is bound to `empty_address`: enqueueV3 needs a non-null address for
    every input (contract SET_INPUT_SHAPE_RETURNS_BOOL), e.g. the image rows of a text-only step."""
    for name, value in inputs.items():
        shape = tuple(int(d) for d in value.shape)
        check_shape(meta, name, shape)
        if not context.set_input_shape(name, shape):
            raise RuntimeError(f"TensorRT refused input shape {list(shape)} for {name}")
    for name, value in {**inputs, **outputs}.items():
        address = value.data_ptr() if math.prod(value.shape) else empty_address
        if not address or not context.set_tensor_address(name, address):
            raise RuntimeError(f"TensorRT refused the address of {name} (not a tensor of this engine, null, or not "
                               "256-byte aligned)")
