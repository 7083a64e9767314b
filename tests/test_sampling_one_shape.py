"""Sampling in one shape from the request to the batch: every `per_row` field of SamplingParams reaches the runner's
SamplingBatch under its name; a field added to SamplingParams alone (here in a fresh interpreter, to a copy of
`runtime/sampling.py`) is range-checked, parsed from a request's options and packed into the batch with nothing
else changed; and every front end builds its SamplingParams through the one request parser."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moe_export.common.errors import InputError
from moe_export.runtime.core.contracts import Request
from moe_export.runtime.core.rows import build_row, pack_rows
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.engine.sampler import SamplingBatch
from moe_export.runtime.request_options import SAMPLING_OPTIONS, parse_request_options
from moe_export.runtime.sampling import ROW_COLUMNS, SamplingParams, SamplingValueError

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
GIVEN = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                       presence_penalty=0.3, frequency_penalty=-0.4)


def packed(*params: SamplingParams) -> SamplingBatch:
    rows = [build_row(Sequence(Request(f"r{j}", [1, 2], p), [1, 2], 2, seed=j), frozenset(), None)
            for j, p in enumerate(params)]
    return pack_rows(rows, list(range(len(rows))), None)


def test_every_per_row_field_reaches_the_batch_under_its_name():
    sb = packed(SamplingParams(), GIVEN)
    assert set(ROW_COLUMNS) <= {f for f in SamplingBatch.__dataclass_fields__}
    for name, (dtype, off) in ROW_COLUMNS.items():
        want = [getattr(SamplingParams(), name), getattr(GIVEN, name)]
        column = getattr(sb, name)
        if off is not None and all(v == off for v in want):
            assert column is None, name
            continue
        assert column.dtype == dtype and column.tolist() == torch.tensor(want, dtype=dtype).tolist(), name
    quiet = packed(SamplingParams(), SamplingParams(temperature=1.0))  # no row penalized: those columns left out
    assert quiet.repetition_penalty is None and quiet.presence_penalty is None and quiet.frequency_penalty is None


def test_every_sampling_field_is_a_request_option():
    assert set(SAMPLING_OPTIONS) == set(SamplingParams.__dataclass_fields__)
    opts = parse_request_options({"temperature": 1, "top_k": -1, "stop": "x", "stop_token_ids": [3],
                                  "logit_bias": {"5": 2}, "tools": []}, SamplingParams(max_tokens=9))
    assert opts.sampling == SamplingParams(temperature=1.0, top_k=0, stop=("x",), stop_token_ids=(3,),
                                           logit_bias={5: 2.0}, max_tokens=9)  # -1: vLLM's "no top-k"
    assert opts.chat_kwargs == {"tools": []}
    with pytest.raises(InputError, match=r"^sampling_parameters: unsupported field\(s\) logit_bias, nope; supported"):
        parse_request_options({"logit_bias": {}, "nope": 1}, SamplingParams(), where="sampling_parameters",
                              excluded=("logit_bias",))
    with pytest.raises(InputError, match=r"^line 3: top_p must be int or float, got 'a'"):
        parse_request_options({"top_p": "a"}, SamplingParams(), where="line 3")
    with pytest.raises(SamplingValueError) as err:  # without `where`: SamplingParams' own error, naming the field
        parse_request_options({"min_p": 2.0}, SamplingParams())
    assert err.value.field == "min_p"
    with pytest.raises(SamplingValueError) as err:  # the parser's own checks name their option too
        parse_request_options({"stop": [""]}, SamplingParams())
    assert err.value.field == "stop"


def test_front_ends_build_sampling_through_the_one_parser():
    """No module of the runtime but the parser merges a request's values into the defaults (`with_defaults`);
    server, Triton, eval and batch's document tasks call `parse_request_options`."""
    merging = sorted(str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*.py")
                     if re.search(r"\bwith_defaults\(", p.read_text()))
    assert merging == ["request_options.py", "sampling.py"], merging
    for front in ("entrypoints/server/service.py", "entrypoints/triton/model.py", "entrypoints/eval.py",
                  "entrypoints/batch/doc_tasks.py"):
        assert "parse_request_options(" in (RUNTIME / front).read_text(), front


NEW_FIELD = r'''
import sys, types
import torch
from pathlib import Path
import moe_export.runtime
from moe_export.common.errors import InputError

src = Path(sys.argv[1]).read_text()
anchor = "    logit_bias: tuple"
assert src.count(anchor) == 1
src = src.replace(anchor, "    typical_p: float = per_row(1.0, torch.float32, off=1.0)\n" + anchor)
mod = types.ModuleType("moe_export.runtime.sampling")
mod.__file__ = sys.argv[1]
sys.modules[mod.__name__] = mod
exec(compile(src, sys.argv[1], "exec"), mod.__dict__)

from moe_export.runtime.core.contracts import Request
from moe_export.runtime.core.rows import build_row, pack_rows
from moe_export.runtime.core.sequence import Sequence
from moe_export.runtime.request_options import parse_request_options
from moe_export.runtime.sampling import SamplingParams, SamplingValueError

try:
    SamplingParams(typical_p=float("inf"))
    raise SystemExit("an infinite typical_p was accepted")
except SamplingValueError as exc:
    assert exc.field == "typical_p", exc
p = parse_request_options({"typical_p": 0.5}, SamplingParams(), where="sampling_parameters").sampling
assert p.typical_p == 0.5, p

def batch(*params):
    rows = [build_row(Sequence(Request(str(j), [1], q), [1], 1, seed=j), frozenset(), None)
            for j, q in enumerate(params)]
    return pack_rows(rows, list(range(len(rows))), None)

sb = batch(p, SamplingParams())
assert sb.typical_p.tolist() == [0.5, 1.0] and sb.typical_p.dtype == torch.float32, sb.typical_p
assert sb.to(torch.device("cpu")).typical_p.tolist() == [0.5, 1.0]
assert batch(SamplingParams()).typical_p is None  # every row at its off value
print("typical_p reached the batch")
'''


def test_a_field_added_to_sampling_params_alone_reaches_the_parser_and_the_batch():
    r = subprocess.run([sys.executable, "-c", NEW_FIELD, str(RUNTIME / "sampling.py")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "typical_p reached the batch" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
