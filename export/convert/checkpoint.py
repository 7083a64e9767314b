"""Read and validate Hugging Face safetensors checkpoints, one tensor at a time.

A checkpoint directory holds `config.json` and either a single `model.safetensors` or shards listed in
`model.safetensors.index.json`. Every shard header is parsed here (without touching tensor data) so
that dtypes, shapes and byte offsets can be checked against the file size and against the tensor
inventory of `moe_export.graphs.weights`. Tensor data is read through `safetensors.safe_open`
(memory-mapped), one tensor (or one slice of a tensor) per call, in its stored dtype. Inside
`CheckpointReader.read_log()` every read is also hashed as it is returned (sha256 of the stored bytes),
which is how a build identifies the source bytes it converted without a separate hashing pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from moe_export.common.errors import InputError
from moe_export.common.model_config import ModelConfig
from moe_export.graphs.weights import TensorSpec, all_tensor_specs, classify_tensor_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# safetensors caps the JSON header at 100 MB; a larger length field means the file is not safetensors.
MAX_HEADER_BYTES = 100_000_000
# Bytes per element of each safetensors dtype string.
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
# How many problems an InputError message lists before summarizing the rest.
MAX_LISTED_PROBLEMS = 40
# Float dtypes a checkpoint may store any float tensor in (fine-tuned and re-saved checkpoints are often
# fp32 or fp16); see `load_dtype` for what the reader hands out.
FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")
_TORCH_FLOAT = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# A slice of a tensor: (dim, start, stop) = indices start:stop of dimension dim; None = the whole tensor.
Part = tuple[int, int, int] | None


def alternate_names(name: str) -> list[str]:
    """Other on-disk spellings of an inventory name that loaders accept: transformers 5 saves Kimi Linear's
    dense first-layer MLP as `layers.N.block_sparse_moe.{gate,up,down}_proj.weight` (originals: `mlp.`)."""
    for proj in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        if name.endswith(".mlp." + proj) and ".layers." in name:
            return [name[: -len("mlp." + proj)] + "block_sparse_moe." + proj]
    return []


def load_dtype(stored: str, expected: str) -> str:
    """The dtype a float tensor stored as `stored` is read in, where the inventory expects `expected`:
    never narrower than stored (an fp32 fine-tune stays fp32), widened to F32 where the model keeps F32
    (A_log, dt_bias, conv weights, router bias), F64 narrowed to F32 (no graph computes in fp64)."""
    if stored == expected or stored not in FLOAT_DTYPES or expected not in FLOAT_DTYPES:
        return stored
    if expected == "F32" or stored == "F64":
        return "F32"
    return stored


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint. kind: missing, unexpected, shape, dtype, truncated, corrupt,
    missing_shard, index, duplicate or value; name: the tensor (None for whole-file problems)."""

    kind: str
    name: str | None
    detail: str
    file: str | None = None

    def __str__(self) -> str:
        where = ", ".join(x for x in (self.file, self.name) if x)
        return f"{self.kind}: {where}: {self.detail}" if where else f"{self.kind}: {self.detail}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as a shard header describes it; offsets are absolute byte positions in the file."""

    name: str
    file: str  # shard file name, relative to the checkpoint directory
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_safetensors_header(path: Path) -> tuple[list[StoredTensor], list[Problem]]:
    """Parse one safetensors file's header and check it against the file size (no tensor data is read).

    Returns the tensors it declares and the problems found. A file whose header cannot be parsed
    yields no tensors and one `truncated` or `corrupt` problem.
    """
    fname = path.name
    size = path.stat().st_size

    def fail(kind: str, detail: str) -> tuple[list[StoredTensor], list[Problem]]:
        return [], [Problem(kind, None, detail, fname)]

    if size < 8:
        return fail("truncated", f"file is {size} bytes; a safetensors file starts with an 8-byte header length")
    with path.open("rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > MAX_HEADER_BYTES:
            return fail("corrupt", f"header length field is {hlen} bytes (limit {MAX_HEADER_BYTES}): not a safetensors file")
        if 8 + hlen > size:
            return fail("truncated", f"header length {hlen} runs past the end of the {size}-byte file")
        raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return fail("corrupt", f"header is not valid JSON ({exc})")
    if not isinstance(header, dict):
        return fail("corrupt", "header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        return fail("corrupt", "header __metadata__ must map strings to strings")

    data_start = 8 + hlen
    tensors, problems = _header_entries(header, fname, data_start)
    if problems:
        return tensors, problems
    return tensors, _layout_problems(tensors, fname, data_start, size)


def _header_entries(header: dict, fname: str, data_start: int) -> tuple[list[StoredTensor], list[Problem]]:
    """The tensors a parsed header declares (byte ranges in the file) and its malformed or inconsistent entries."""
    tensors: list[StoredTensor] = []
    problems: list[Problem] = []
    for name, entry in header.items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])
            and 0 <= entry["data_offsets"][0] <= entry["data_offsets"][1]
        )
        if not ok:
            problems.append(Problem("corrupt", name, f"malformed header entry {entry!r}", fname))
            continue
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            problems.append(Problem("dtype", name, f"unsupported safetensors dtype {dtype!r}", fname))
            continue
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * SAFETENSORS_DTYPES[dtype]:
            problems.append(
                Problem("corrupt", name, f"{dtype}{list(shape)} needs {numel * SAFETENSORS_DTYPES[dtype]} bytes "
                        f"but its data_offsets span {end - begin}", fname)
            )
            continue
        tensors.append(StoredTensor(name, fname, dtype, shape, data_start + begin, data_start + end))
    return tensors, problems


def _layout_problems(tensors: list[StoredTensor], fname: str, data_start: int, size: int) -> list[Problem]:
    """Holes, overlaps, tensors past the end of the `size`-byte file and stray bytes after the last tensor.
    Sorts `tensors` by byte range."""
    problems: list[Problem] = []
    tensors.sort(key=lambda t: (t.start, t.end))
    pos = data_start
    for t in tensors:
        if t.start != pos:
            gap = "overlaps the previous tensor" if t.start < pos else f"leaves a {t.start - pos}-byte hole before it"
            problems.append(Problem("corrupt", t.name, f"data_offsets {gap}", fname))
        pos = max(pos, t.end)
    past = [t for t in tensors if t.end > size]
    if past:
        problems.append(
            Problem("truncated", past[0].name,
                    f"file is {size} bytes but its header needs {pos}; {len(past)} tensor(s) lie past the end, "
                    "the first named here", fname)
        )
    elif pos < size:
        problems.append(Problem("corrupt", None, f"{size - pos} stray bytes after the last tensor", fname))
    return problems


def _sha256(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's bytes in C order (its stored representation: little-endian)."""
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _refuse_pickle(root: Path) -> None:
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InputError(
            f"{root}: only pickle weights found ({', '.join(pickles[:4])}{', ...' if len(pickles) > 4 else ''}). "
            "Pickle checkpoints can run arbitrary code when loaded and are refused; convert them to safetensors "
            f"({SINGLE_FILE} or sharded with {INDEX_FILE})"
        )


class CheckpointReader:
    """A Hugging Face safetensors checkpoint directory, read lazily one tensor at a time.

    Construction parses config.json (InputError if it is unusable), the index and every shard header;
    problems with the files are collected, not raised: see `validate()` and `open_checkpoint()`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise InputError(f"{self.path}: not a checkpoint directory")
        self.config = ModelConfig.from_pretrained(self.path)
        self._problems: list[Problem] = []
        self._tensors: dict[str, StoredTensor] = {}
        self._index: dict[str, str] | None = None  # tensor name -> shard file, from the index
        self._bad_files: set[str] = set()  # shards whose header could not be parsed (or that are missing)
        self._handles: dict[str, object] = {}
        self.bytes_read = 0  # tensor data bytes read from the files so far (get, get_part, digest)
        self._log: dict[tuple[str, str, Part], str] | None = None  # see read_log()
        self._specs: list[TensorSpec] | None = None
        self.files = self._discover()
        per_file = Counter((self._index or {}).values())
        for fname in self.files:
            fpath = self.path / fname
            if not fpath.is_file():
                self._bad_files.add(fname)
                self._problems.append(
                    Problem("missing_shard", None, f"the index maps {per_file[fname]} tensor(s) to this file, which does not exist", fname)
                )
                continue
            tensors, problems = read_safetensors_header(fpath)
            self._problems.extend(problems)
            if problems:  # safe_open refuses a file with any header problem
                self._bad_files.add(fname)
            for t in tensors:
                if t.name in self._tensors:
                    self._problems.append(
                        Problem("duplicate", t.name, f"also stored in {self._tensors[t.name].file}", fname)
                    )
                    continue
                self._tensors[t.name] = t
        self._check_index()
        self._alias: dict[str, str] = {}  # inventory name -> the spelling this checkpoint stores it under
        self._expected_dtype: dict[str, str] = {}
        for spec in self.expected_specs():
            self._expected_dtype[spec.name] = spec.dtype
            if spec.name not in self._tensors:
                found = [alt for alt in alternate_names(spec.name) if alt in self._tensors]
                if found:
                    self._alias[spec.name] = found[0]

    # ---- layout discovery ----
    def _discover(self) -> list[str]:
        """Shard file names in index order (or the single file); records index problems."""
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                self._problems.append(Problem("corrupt", None, f"not valid JSON ({exc})", INDEX_FILE))
                return []
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                self._problems.append(Problem("corrupt", None, "'weight_map' must map tensor names to file names", INDEX_FILE))
                return []
            escaping = sorted(v for v in set(weight_map.values()) if Path(v).name != v)
            if escaping:
                self._problems.append(Problem("corrupt", None, f"shard names must be plain file names, got {escaping[:3]}", INDEX_FILE))
                return []
            self._index = weight_map
            return list(dict.fromkeys(weight_map.values()))
        if (self.path / SINGLE_FILE).is_file():
            return [SINGLE_FILE]
        _refuse_pickle(self.path)
        raise InputError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE} found")

    def _check_index(self) -> None:
        if self._index is None:
            return
        for name, fname in self._index.items():
            if fname in self._bad_files:
                continue
            stored = self._tensors.get(name)
            if stored is None:
                self._problems.append(Problem("missing", name, "listed in the index but absent from this file", fname))
            elif stored.file != fname:
                self._problems.append(Problem("index", name, f"the index says {fname} but it is stored here", stored.file))
        for name, stored in self._tensors.items():
            if name not in self._index:
                self._problems.append(
                    Problem("index", name, "stored in this file but not listed in the index (loaders would skip it)", stored.file)
                )

    # ---- public API ----
    def tensor_names(self) -> list[str]:
        """Names of the tensors the shard headers declare, in storage order (shard by shard, by offset)."""
        order = {f: i for i, f in enumerate(self.files)}
        return [t.name for t in sorted(self._tensors.values(), key=lambda t: (order[t.file], t.start))]

    def stored(self, name: str) -> StoredTensor:
        """Header facts (file, dtype, shape, byte range) of one tensor, by its inventory name or its stored
        spelling; KeyError if absent."""
        return self._tensors[self._alias.get(name, name)]

    def __contains__(self, name: str) -> bool:
        return self._alias.get(name, name) in self._tensors

    def nbytes(self, name: str) -> int:
        return self.stored(name).nbytes

    def load_dtype(self, name: str) -> str:
        """The safetensors dtype `get(name)` returns (see the module function `load_dtype`)."""
        stored = self.stored(name).dtype
        return load_dtype(stored, self._expected_dtype.get(name, stored))

    def dtype_report(self) -> dict[str, int]:
        """What reading does to float tensors stored in another dtype than the model's checkpoints use:
        '<stored> kept (expected <dtype>)' or '<stored> cast to <dtype> (expected <dtype>)' -> tensor count."""
        out: dict[str, int] = {}
        for name, expected in self._expected_dtype.items():
            if name not in self:
                continue
            stored = self.stored(name).dtype
            if stored == expected or stored not in FLOAT_DTYPES or expected not in FLOAT_DTYPES:
                continue
            got = load_dtype(stored, expected)
            what = f"{stored} kept" if got == stored else f"{stored} cast to {got}"
            key = f"{what} (expected {expected})"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def expected_specs(self) -> list[TensorSpec]:
        """The language-model tensors the config implies (see `moe_export.graphs.weights`); computed once."""
        if self._specs is None:
            self._specs = all_tensor_specs(self.config)
        return self._specs

    def vision_specs(self) -> list[TensorSpec]:
        """K3's vision tower and projector tensors its `vision_config` implies (bf16, never quantized); empty
        for a text-only config."""
        from moe_export.graphs.vision import vision_config, vision_tensor_specs

        vc = vision_config(self.config)
        return vision_tensor_specs(vc) if vc is not None else []

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (by inventory name or stored spelling) in `load_dtype(name)`: its stored dtype
        (U8 for MXFP4 packed weights and scales) unless a float cast is needed."""
        return self.get_part(name, None)

    def get_part(self, name: str, part: Part) -> torch.Tensor:
        """`get(name)` restricted to indices start:stop of dimension dim (`part` = (dim, start, stop), None =
        whole): only those bytes are read from the file (the tensor-parallel shard of one rank)."""
        stored = self.stored(name)
        tensor = self._read(stored, part)
        want = self.load_dtype(name)
        return tensor if want == stored.dtype else tensor.to(_TORCH_FLOAT[want])

    def digest(self, name: str, part: Part) -> str:
        """sha256 (hex) of the stored bytes `get_part(name, part)` reads, before any cast (C order of the slice)."""
        return _sha256(self._read(self.stored(name), part))

    @contextlib.contextmanager
    def read_log(self) -> Iterator[dict[tuple[str, str, Part], str]]:
        """Log every read inside the block: {(shard file, stored name, part): sha256 hex of the bytes read}.

        Every shard is (re)opened inside the block (open memory maps are closed first), so the bytes
        logged are those of the files as they were when the block began or later, never of an earlier
        version of a file replaced since (see `export.build.source_reads`)."""
        if self._log is not None:
            raise RuntimeError("read_log() blocks do not nest")
        self.close()
        self._log = {}
        try:
            yield self._log
        finally:
            self._log = None

    def layout_digest(self) -> str:
        """sha256 (hex) of the shard headers' tensor table: every tensor's name, file, dtype, shape and byte
        range, by name. The checkpoint's structure without its tensor data (no data is read)."""
        h = hashlib.sha256()
        for name in sorted(self._tensors):
            t = self._tensors[name]
            h.update(f"{name}\0{t.file}\0{t.dtype}\0{list(t.shape)}\0{t.start}\0{t.end}\n".encode())
        return h.hexdigest()

    def _read(self, stored: StoredTensor, part: Part) -> torch.Tensor:
        """The stored bytes of `stored` (or of its slice `part`) as a tensor of its stored dtype; counted,
        and hashed inside `read_log()`."""
        handle = self._handle(stored)
        if part is None:
            tensor = handle.get_tensor(stored.name)
        else:
            dim, start, stop = part
            tensor = handle.get_slice(stored.name)[(slice(None),) * dim + (slice(start, stop),)]  # reads the slice only
        self.bytes_read += tensor.numel() * SAFETENSORS_DTYPES[stored.dtype]
        if self._log is not None:
            self._log[(stored.file, stored.name, None if part is None else tuple(part))] = _sha256(tensor)
        return tensor

    def _handle(self, stored: StoredTensor):
        if stored.file in self._bad_files:
            raise InputError(f"{self.path / stored.file}: cannot read tensor {stored.name}: the file is truncated or corrupt")
        handle = self._handles.get(stored.file)
        if handle is None:
            from safetensors import safe_open

            try:
                handle = safe_open(str(self.path / stored.file), framework="pt")
            except Exception as exc:  # safetensors raises SafetensorError (not exported) on bad files
                raise InputError(f"{self.path / stored.file}: cannot open ({exc})") from None
            self._handles[stored.file] = handle
        return handle

    def release(self, file: str) -> None:
        """Close one shard's memory map (its tensors already returned stay valid: they are copies)."""
        self._handles.pop(file, None)

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, in storage order (or in the order of `names`)."""
        for name in self.tensor_names() if names is None else names:
            yield name, self.get(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def validate(self) -> list[Problem]:
        """Every problem: unreadable files, index disagreements, and tensors missing, unexpected, or of
        the wrong shape or dtype against the config's inventory; K3's A_log padding must be zero."""
        problems = list(self._problems)
        specs = {s.name: s for s in self.expected_specs() + self.vision_specs()}
        # A name the index lists was already reported (or sits in an unreadable shard). With a corrupt
        # index or an unreadable lone model.safetensors every tensor would be "missing": report the file only.
        if self._index is not None:
            skip_missing = set(self._index)
        elif self._bad_files or not self.files:
            skip_missing = set(specs)
        else:
            skip_missing = set()
        for name, spec in specs.items():
            stored = self._tensors.get(self._alias.get(name, name))
            if stored is None:
                if name not in skip_missing:
                    problems.append(
                        Problem("missing", name, f"expected {spec.dtype}{list(spec.shape)} ({spec.weight_class})", None)
                    )
                continue
            if stored.shape != spec.shape:
                problems.append(
                    Problem("shape", name, f"stored shape {list(stored.shape)}, expected {list(spec.shape)}", stored.file)
                )
            if stored.dtype != spec.dtype and not (stored.dtype in FLOAT_DTYPES and spec.dtype in FLOAT_DTYPES):
                problems.append(Problem("dtype", name, f"stored {stored.dtype}, expected {spec.dtype}", stored.file))
        aliased = set(self._alias.values())
        for name, stored in self._tensors.items():
            if name not in specs and name not in aliased and classify_tensor_name(name) != "vision":
                problems.append(Problem("unexpected", name, f"{stored.dtype}{list(stored.shape)} is not part of this model", stored.file))
        problems.extend(self._check_values(specs))
        return problems

    def _check_values(self, specs: dict[str, TensorSpec]) -> list[Problem]:
        """K3 stores A_log as [head_dim] with one value per head; the padding past num_heads must be 0."""
        out: list[Problem] = []
        if self.config.model_type != "kimi_k3":
            return out
        nh = self.config.kda_num_heads
        for name, spec in specs.items():
            stored = self._tensors.get(name)
            if not name.endswith(".A_log") or stored is None or stored.shape != spec.shape or stored.dtype not in FLOAT_DTYPES:
                continue
            if stored.file in self._bad_files:
                continue
            tail = self.get(name)[nh:]
            if tail.numel() and bool((tail != 0).any()):
                out.append(Problem("value", name, f"entries {nh}.. past the {nh} heads must be zero padding", stored.file))
        return out


def format_problems(path: str | Path, problems: list[Problem]) -> str:
    """One paragraph: a count by kind, then each problem (at most MAX_LISTED_PROBLEMS of them)."""
    counts: dict[str, int] = {}
    for p in problems:
        counts[p.kind] = counts.get(p.kind, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    lines = [f"{path}: checkpoint has {len(problems)} problem(s) ({summary}):"]
    lines += [f"  {p}" for p in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more (`moe-export inspect {path} --json` lists all)")
    return "\n".join(lines)


def open_checkpoint(path: str | Path, validate: bool = True) -> CheckpointReader:
    """Open a checkpoint; with `validate`, raise one InputError listing every problem found."""
    reader = CheckpointReader(path)
    if validate:
        problems = reader.validate()
        if problems:
            reader.close()
            raise InputError(format_problems(reader.path, problems))
    return reader


def checkpoint_fingerprint(path: str | Path, chunk_bytes: int = 1 << 24) -> dict[str, str]:
    """sha256 (hex) of config.json, the index and every weight shard, streamed in `chunk_bytes` reads.

    Keys are file names relative to the checkpoint directory, sorted.
    """
    root = Path(path)
    names = {"config.json"}
    index = root / INDEX_FILE
    if index.is_file():
        names.add(INDEX_FILE)
        names.update(json.loads(index.read_text())["weight_map"].values())
    else:
        names.add(SINGLE_FILE)
    out: dict[str, str] = {}
    for name in sorted(names):
        h = hashlib.sha256()
        try:
            with (root / name).open("rb") as f:
                while chunk := f.read(chunk_bytes):
                    h.update(chunk)
        except FileNotFoundError:
            raise InputError(f"{root / name}: missing; cannot fingerprint the checkpoint") from None
        out[name] = h.hexdigest()
    return out


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The reference model (`graphs.model.KimiModel`) of an HF-format checkpoint directory, validated first
    (InputError listing every problem)."""
    from moe_export.graphs.model import KimiModel

    with open_checkpoint(path) as reader:
        return KimiModel.from_source(reader, dtype)
