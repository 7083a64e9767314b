"""`rank{N}.engine` / `vision.engine` files: a safetensors file holding one uint8 tensor `engine` (TensorRT's
serialized plan) and in the metadata `trt_engine` (JSON, see `export/backends/tensorrt/engine.py`) and
`tensorrt_version`.

Streamed both ways, so a rank never holds a second host copy of its plan (contract ENGINE_STREAMS,
`plugins/tensorrt_contracts.py`):
  - writing: `EngineFileWriter` reserves the header's room, takes the plan in the chunks TensorRT hands an
    `IStreamWriter` (or one buffer, written without a copy), and writes the header last (safetensors allows a
    header padded with spaces);
  - reading: `stream_reader` is a `trt.IStreamReaderV2` over the file's `engine` bytes that TensorRT pulls in
    chunks of at most `READ_CHUNK` bytes (the bindings copy each chunk straight to its destination, device memory
    for the weights); `read_engine_meta` reads the header only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from moe_export.common.errors import InputError

ENGINE_KEY = "trt_engine"  # metadata entry holding the build's JSON description of the engine
ENGINE_TENSOR = "engine"  # the uint8 tensor holding TensorRT's serialized plan
VISION_ENGINE = "vision.engine"  # K3's vision tower engine, one file in the engine directory every rank loads
HEADER_RESERVE = 1 << 20  # bytes kept for the safetensors header (length word + JSON padded with spaces)
READ_CHUNK = 64 << 20  # the most bytes one read hands TensorRT (the reader's host buffer)


def rank_engine_name(rank: int) -> str:
    """File name of a rank's engine inside its rank folder."""
    return f"rank{rank}.engine"


class EngineFileWriter:
    """Writes a plan into `path` as the safetensors tensor `engine` (a context manager; the file closes on exit):
    `write` (the IStreamWriter protocol: bytes or any buffer -> bytes written) appends after the header's room,
    `finish(metadata)` writes the header."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 (held open across write() calls; finish() closes it)
        self._file.seek(HEADER_RESERVE)
        self.size = 0

    def write(self, data) -> int:
        written = self._file.write(data)
        self.size += written
        return written

    def __enter__(self) -> EngineFileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    @property
    def data_offset(self) -> int:
        """Where the plan starts in the file."""
        return HEADER_RESERVE

    def flush(self) -> None:
        self._file.flush()

    def finish(self, metadata: dict[str, str]) -> None:
        """The header (`metadata` and the tensor's extent) into the reserved room."""
        header = {"__metadata__": metadata,
                  ENGINE_TENSOR: {"dtype": "U8", "shape": [self.size], "data_offsets": [0, self.size]}}  # fmt: skip
        text = json.dumps(header).encode()
        room = HEADER_RESERVE - 8
        if len(text) > room:
            raise InputError(f"{self.path}: engine metadata of {len(text)} bytes exceeds the {room} reserved")
        self._file.seek(0)
        self._file.write(struct.pack("<Q", room) + text + b" " * (room - len(text)))
        self._file.flush()


def _header(path: Path) -> tuple[dict, int]:
    """(safetensors header, offset of the data) of `path`, InputErrors naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: missing (was this engine built with backend tensorrt?)")
    with open(path, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= 100 << 20:
            raise InputError(f"{path}: not a safetensors file")
        return json.loads(f.read(size)), 8 + size


def read_engine_meta(path: Path) -> tuple[dict, int, int]:
    """(metadata `trt_engine`, offset and size in bytes of the plan) of an engine file, reading its header only."""
    header, data_start = _header(path)
    meta = header.get("__metadata__") or {}
    if ENGINE_KEY not in meta:
        raise InputError(f"{path}: not a moe-export TensorRT engine file (no {ENGINE_KEY} metadata; engines "
                         "built before one-engine-per-rank must be rebuilt)")
    if ENGINE_TENSOR not in header:
        raise InputError(f"{path}: no {ENGINE_TENSOR!r} tensor")
    begin, end = header[ENGINE_TENSOR]["data_offsets"]
    return json.loads(meta[ENGINE_KEY]), data_start + begin, end - begin


def read_engine_file(path: Path) -> tuple[dict, bytes]:
    """(metadata `trt_engine`, serialized TensorRT engine) of an engine file, the plan read whole (inspection and
    tests; the runners stream it with `stream_reader`)."""
    meta, offset, size = read_engine_meta(path)
    with open(path, "rb") as f:
        f.seek(offset)
        return meta, f.read(size)


def stream_reader(trt, path: Path, offset: int, size: int):
    """A `trt.IStreamReaderV2` over bytes [offset, offset + size) of `path` (pass it to
    `Runtime.deserialize_cuda_engine`); reads at most READ_CHUNK bytes at a time."""

    class EngineReader(trt.IStreamReaderV2):
        def __init__(self):
            trt.IStreamReaderV2.__init__(self)
            self.file = open(path, "rb")  # noqa: SIM115 (held open across read() calls by TensorRT)
            self.file.seek(offset)
            self.position = 0

        def read(self, num_bytes: int, stream: int) -> bytes:
            data = self.file.read(max(0, min(num_bytes, READ_CHUNK, size - self.position)))
            self.position += len(data)
            return data

        def seek(self, where_to: int, whence) -> bool:
            target = {trt.SeekPosition.SET: where_to, trt.SeekPosition.CUR: self.position + where_to,
                      trt.SeekPosition.END: size - where_to}[whence]  # END counts back from the end
            if not 0 <= target <= size:
                return False
            self.position = target
            self.file.seek(offset + target)
            return True

    return EngineReader()


def stream_writer(trt, sink: EngineFileWriter):
    """A `trt.IStreamWriter` handing TensorRT's chunks to `sink`."""

    class EngineWriter(trt.IStreamWriter):
        def __init__(self):
            trt.IStreamWriter.__init__(self)

        def write(self, data: bytes) -> int:
            return sink.write(data)

    return EngineWriter()
