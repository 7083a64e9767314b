"""Documents of a folder as batch items: discovery, text extraction and the reasons a file is refused.

Supported: .txt .md (UTF-8 text), .html/.htm (inscriptis: layout-aware HTML-to-text, scripts and styles
dropped), .pdf (pypdf, text of every page), .jsonl (one document per line: {"text": ..., "id": optional}).
pypdf's warnings about a damaged but readable PDF are not printed: they are the document's `warnings`
(kept in its output line). A file is refused, as an error item, when it is empty or has no text, is binary (NUL bytes), is not
valid UTF-8, is larger than `max_file_bytes`, or (a .jsonl line) is not a JSON object with a string text.

With `images` (`batch --images`, K3 engines with a vision tower) image files (.png .jpg .jpeg .webp .gif) are
documents too, each one image and no text, and a PDF brings the images pypdf finds on its pages (`page.images`;
formats other than PNG / JPEG / WebP / GIF re-encoded as PNG by Pillow), each tagged with the character offset
of its page in the document's text, so the chunk holding that page's text carries it. A PDF with images needs
no text. An image file that Pillow cannot read is refused like any unreadable document; a PDF image pypdf
cannot extract is named in the document's warnings. Without `images` image files are not documents
(`image_files` counts them for the summary) and PDFs give their text only.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moe_export.common.errors import InputError

SUFFIXES = (".txt", ".md", ".html", ".htm", ".pdf", ".jsonl")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")
BINARY_PROBE_BYTES = 8192


@dataclass(frozen=True)
class DocImage:
    """One image of a document: a data URL (an OpenAI image_url part's url), where it comes from (for error
    lines), and the character offset in the document's text of the page it is on (0 for an image file)."""

    url: str
    source: str
    offset: int = 0


@dataclass
class Document:
    """One document, or the reason it cannot be one (`error_code` set, `text` empty)."""

    custom_id: str  # path relative to the input folder (+ "#id" for a .jsonl record)
    text: str = ""
    content_hash: str = ""  # "sha256:HEX" of the source bytes (of the record's line for .jsonl)
    error_code: str | None = None
    error_message: str | None = None
    warnings: tuple[str, ...] = ()  # what the extractor reported about a damaged but readable file
    images: tuple[DocImage, ...] = ()  # with --images: the image file, or the PDF's page images

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


def image_url(data: bytes, where: str) -> str:
    """A data URL of encoded image bytes; PNG / JPEG / WebP / GIF kept as they are, any other format Pillow
    reads re-encoded as PNG (InputError naming `where` if Pillow cannot read it)."""
    from moe_export.runtime.images import IMAGE_FORMATS, decode_image
    from PIL import Image, UnidentifiedImageError

    try:
        fmt = Image.open(io.BytesIO(data)).format
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"{where}: not a readable image ({exc})") from None
    if fmt not in IMAGE_FORMATS:
        buf = io.BytesIO()
        try:
            Image.open(io.BytesIO(data)).save(buf, "PNG")
        except (OSError, ValueError) as exc:
            raise InputError(f"{where}: cannot re-encode the {fmt} image as PNG ({exc})") from None
        data, fmt = buf.getvalue(), "PNG"
    decode_image(data, where)  # the checks an image part gets (size, pixels, a full decode)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"


def _pdf_images(page, page_no: int, rel: str, offset: int, warnings: list[str]) -> list[DocImage]:
    """The images pypdf finds on one page; one it cannot extract or Pillow cannot read is a warning."""
    found = []
    try:
        files = list(page.images)
    except Exception as exc:  # pypdf raises many types on damaged XObjects: the page's images are reported lost
        warnings.append(f"page {page_no}: images not extracted ({type(exc).__name__}: {exc})")
        return found
    for image in files:
        where = f"{rel} page {page_no} image {image.name}"
        try:
            found.append(DocImage(image_url(image.data, where), where, offset))
        except InputError as exc:
            warnings.append(f"{exc} (left out)")
    return found


def _pdf_content(path: Path, rel: str, images: bool) -> tuple[str, tuple[str, ...], tuple[DocImage, ...]]:
    """(text of every page, pypdf's warnings while reading it, the page images if `images`)."""
    from pypdf import PdfReader

    logger = logging.getLogger("pypdf")
    collected = _Collected()
    logger.addHandler(collected)
    propagate, logger.propagate = logger.propagate, False
    notes: list[str] = []
    found: list[DocImage] = []
    try:
        reader = PdfReader(str(path))
        texts: list[str] = []
        offset = 0
        for page_no, page in enumerate(reader.pages, 1):
            if images:
                found += _pdf_images(page, page_no, rel, offset, notes)
            texts.append(page.extract_text() or "")
            offset += len(texts[-1]) + 2  # the "\n\n" between pages
        text = "\n\n".join(texts)
    finally:
        logger.removeHandler(collected)
        logger.propagate = propagate
    return text, tuple(dict.fromkeys(collected.messages + notes)), tuple(found)


def image_files(folder: Path) -> list[Path]:
    """The image files under `folder` (what `--images` makes documents), sorted, hidden ones left out."""
    return _files(folder, IMAGE_SUFFIXES)


def _files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return [p for p in _files_all(folder) if p.suffix.lower() in suffixes]


def files_of_other_types(folder: Path) -> list[Path]:
    """The files under `folder` of a type no run reads (image files, read with --images only, are not among
    them: `image_files`), hidden ones left out."""
    return [p for p in _files_all(folder) if p.suffix.lower() not in SUFFIXES + IMAGE_SUFFIXES]


def _files_all(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def read_documents(folder: Path, max_file_bytes: int, images: bool = False) -> Iterator[Document]:
    """Every document under `folder` (recursive, sorted by path), refused ones included; with `images`, image
    files and the images of PDFs too."""
    for path in _files(folder, SUFFIXES + IMAGE_SUFFIXES if images else SUFFIXES):
        rel = path.relative_to(folder).as_posix()
        size = path.stat().st_size
        if size > max_file_bytes:
            yield Document(rel, content_hash=f"size:{size}:mtime:{path.stat().st_mtime_ns}", error_code="over_long",
                           error_message=f"{rel}: {size} bytes, over the {max_file_bytes}-byte limit (--max-file-bytes)")
            continue
        data = path.read_bytes()
        digest = content_hash(data)
        suffix = path.suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            try:
                yield Document(rel, content_hash=digest, images=(DocImage(image_url(data, rel), rel),))
            except InputError as exc:
                yield Document(rel, content_hash=digest, error_code="undecodable", error_message=str(exc))
            continue
        if suffix == ".pdf":
            from pypdf.errors import PdfReadError  # pypdf is imported for PDFs only

            try:
                text, warnings, found = _pdf_content(path, rel, images)
                if images:  # the same file read with its images is another job: its own resume key
                    digest += "+images"
                doc = Document(rel, text=text, content_hash=digest, images=found) if found else _text_document(rel, text, digest)
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
