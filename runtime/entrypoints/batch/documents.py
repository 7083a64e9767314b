"""Documents of a folder as batch items: discovery, text extraction and the reasons a file is refused.

Supported: .txt .md (UTF-8 text), .html/.htm (inscriptis: layout-aware HTML-to-text, scripts and styles
dropped), .pdf (pypdf, text of every page), .jsonl (one document per line: {"text": ..., "id": optional}).
pypdf's warnings about a damaged but readable PDF are not printed: they are the document's `warnings`
(kept in its output line). A file is refused, as an error item, when it is empty or has no text, is binary (NUL bytes), is not
valid UTF-8, is larger than `max_file_bytes`, or (a .jsonl line) is not a JSON object with a string text.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".txt", ".md", ".html", ".htm", ".pdf", ".jsonl")
BINARY_PROBE_BYTES = 8192


@dataclass
class Document:
    """One document, or the reason it cannot be one (`error_code` set, `text` empty)."""

    custom_id: str  # path relative to the input folder (+ "#id" for a .jsonl record)
    text: str = ""
    content_hash: str = ""  # "sha256:HEX" of the source bytes (of the record's line for .jsonl)
    error_code: str | None = None
    error_message: str | None = None
    warnings: tuple[str, ...] = ()  # what the extractor reported about a damaged but readable file

    @property
    def key(self) -> str:
        """Resume key: the same file with the same content is done once."""
        return f"{self.custom_id}@{self.content_hash}"


def content_hash(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _decode_utf8(data: bytes, where: str) -> tuple[str | None, Document | None]:
    if b"\x00" in data[:BINARY_PROBE_BYTES]:
        return None, Document(where, content_hash=content_hash(data), error_code="binary_file",
                              error_message=f"{where}: binary file (NUL bytes), not a text document")
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, Document(where, content_hash=content_hash(data), error_code="undecodable",
                              error_message=f"{where}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})")


def _text_document(custom_id: str, text: str, digest: str) -> Document:
    if not text.strip():
        return Document(custom_id, content_hash=digest, error_code="empty_document",
                        error_message=f"{custom_id}: no text (empty or whitespace only)")
    return Document(custom_id, text=text, content_hash=digest)


class _Collected(logging.Handler):
    """Log records of one extraction, kept as messages instead of printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _pdf_text(path: Path) -> tuple[str, tuple[str, ...]]:
    """(text of every page, pypdf's warnings while reading it)."""
    from pypdf import PdfReader

    logger = logging.getLogger("pypdf")
    collected = _Collected()
    logger.addHandler(collected)
    propagate, logger.propagate = logger.propagate, False
    try:
        reader = PdfReader(str(path))
        text = "\n\n".join((page.extract_text() or "") for page in reader.pages)
    finally:
        logger.removeHandler(collected)
        logger.propagate = propagate
    return text, tuple(dict.fromkeys(collected.messages))


def read_documents(folder: Path, max_file_bytes: int) -> Iterator[Document]:
    """Every document under `folder` (recursive, sorted by path), refused ones included."""
    from pypdf.errors import PdfReadError

    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    for path in files:
        rel = path.relative_to(folder).as_posix()
        size = path.stat().st_size
        if size > max_file_bytes:
            yield Document(rel, content_hash=f"size:{size}:mtime:{path.stat().st_mtime_ns}", error_code="over_long",
                           error_message=f"{rel}: {size} bytes, over the {max_file_bytes}-byte limit (--max-file-bytes)")
            continue
        data = path.read_bytes()
        digest = content_hash(data)
        suffix = path.suffix.lower()
        if suffix == ".pdf":
            try:
                text, warnings = _pdf_text(path)
                doc = _text_document(rel, text, digest)
                doc.warnings = warnings
                yield doc
            except (PdfReadError, ValueError, KeyError, OSError) as exc:
                yield Document(rel, content_hash=digest, error_code="undecodable",
                               error_message=f"{rel}: unreadable PDF ({type(exc).__name__}: {exc})")
            continue
        text, refused = _decode_utf8(data, rel)
        if refused is not None:
            yield refused
        elif suffix in (".html", ".htm"):
            import inscriptis

            yield _text_document(rel, inscriptis.get_text(text), digest)
        elif suffix == ".jsonl":
            yield from _jsonl_documents(rel, text)
        else:
            yield _text_document(rel, text, digest)


def _jsonl_documents(rel: str, text: str) -> Iterator[Document]:
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest = content_hash(line.encode())
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Document(f"{rel}#line{line_no}", content_hash=digest, error_code="bad_record",
                           error_message=f"{rel} line {line_no}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            yield Document(f"{rel}#line{line_no}", content_hash=digest, error_code="bad_record",
                           error_message=f"{rel} line {line_no}: expected an object with a string 'text' field")
            continue
        rid = record.get("id")
        yield _text_document(f"{rel}#{rid if rid is not None else f'line{line_no}'}", record["text"], digest)
