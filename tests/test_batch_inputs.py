"""Batch building blocks that need no engine: document extraction and refusal reasons, chunking with
overlap, the whole-or-absent output log, OpenAI batch input lines."""

from __future__ import annotations

import json
import os

import pytest
from moe_export.common.errors import InputError
from moe_export.runtime.entrypoints.batch.chunking import chunk_text
from moe_export.runtime.entrypoints.batch.documents import files_of_other_types, read_documents
from moe_export.runtime.entrypoints.batch.openai_batch import parse_input_line
from moe_export.runtime.entrypoints.batch.output import ResultLog


def byte_count(text: str) -> int:
    return len(text.encode("utf-8"))


def word_count(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("count,budget,overlap", [(byte_count, 120, 30), (byte_count, 40, 0), (word_count, 7, 3)])
def test_chunks_fit_cover_in_order_and_overlap(count, budget, overlap):
    words = [f"w{i}{'x' * (i % 9)}" for i in range(300)]
    text = " ".join(words) + "\n"
    chunks = chunk_text(text, count, budget, overlap)
    assert len(chunks) > 3
    assert all(count(c) <= budget for c in chunks)
    assert text.startswith(chunks[0]) and text.endswith(chunks[-1])
    pos = 0  # each chunk starts at or before the previous one's end, and the shared part is <= overlap
    for prev, cur in zip(chunks, chunks[1:]):
        start = text.index(prev, pos)
        end = start + len(prev)
        nxt = text.index(cur, start + 1)
        assert start < nxt <= end
        assert count(text[nxt:end]) <= overlap
        if overlap == 0:
            assert nxt == end
        pos = start + 1
    rebuilt = chunks[0]
    for cur in chunks[1:]:
        shared = max(k for k in range(len(cur) + 1) if rebuilt.endswith(cur[:k]))
        rebuilt += cur[shared:]
    assert rebuilt == text


def test_chunking_cuts_an_overlong_word_and_keeps_short_text_whole():
    assert chunk_text("short text", byte_count, 100, 10) == ["short text"]
    long_word = "é" * 50 + "z" * 30  # multi-byte characters: pieces never split a character
    chunks = chunk_text(long_word, byte_count, 16, 0)
    assert "".join(chunks) == long_word and all(byte_count(c) <= 16 for c in chunks)
    with pytest.raises(ValueError):
        chunk_text("x y", byte_count, 10, 10)


def write_pdf(path, text: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"pdf.fonttype": 42}):
        fig = plt.figure()
        fig.text(0.1, 0.5, text)
        fig.savefig(path)
        plt.close(fig)


def test_documents_extracted_and_bad_ones_refused(tmp_path):
    (tmp_path / "a.txt").write_text("plain text document")
    (tmp_path / "b.md").write_text("# Title\n\nmarkdown body")
    (tmp_path / "c.html").write_text("<html><head><script>var hidden = 1;</script><style>p{}</style></head>"
                                     "<body><h1>Report</h1><p>Revenue <b>rose</b>.</p></body></html>")
    write_pdf(tmp_path / "d.pdf", "Quarterly revenue grew 12 percent")
    (tmp_path / "e.jsonl").write_text('{"id": "r1", "text": "first record"}\nnot json\n{"text": 5}\n{"text": "second"}\n')
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bin.txt").write_bytes(b"abc\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (tmp_path / "huge.txt").write_text("x" * 300_000)
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4 garbage")
    (tmp_path / "ignored.csv").write_text("a,b")
    docs = {d.custom_id: d for d in read_documents(tmp_path, max_file_bytes=200_000)}
    assert docs["a.txt"].text == "plain text document" and docs["a.txt"].error_code is None
    assert "markdown body" in docs["b.md"].text
    html = docs["c.html"].text
    assert "Report" in html and "Revenue rose." in html and "hidden" not in html and "<" not in html
    assert docs["d.pdf"].text.strip() == "Quarterly revenue grew 12 percent"
    assert docs["e.jsonl#r1"].text == "first record" and docs["e.jsonl#line4"].text == "second"
    assert docs["e.jsonl#line2"].error_code == "bad_record" and docs["e.jsonl#line3"].error_code == "bad_record"
    assert docs["empty.txt"].error_code == "empty_document"
    assert docs["bin.txt"].error_code == "binary_file"
    assert docs["latin1.txt"].error_code == "undecodable" and "0xe9" in docs["latin1.txt"].error_message
    assert docs["huge.txt"].error_code == "over_long" and "--max-file-bytes" in docs["huge.txt"].error_message
    assert docs["broken.pdf"].error_code == "undecodable"
    assert "ignored.csv" not in docs

    assert docs["a.txt"].content_hash.startswith("sha256:") and docs["a.txt"].key.startswith("a.txt@sha256:")

def test_damaged_pdf_warnings_are_kept_with_the_document_not_printed(tmp_path, capfd):
    import re

    write_pdf(tmp_path / "ok.pdf", "Damaged but readable")
    data = (tmp_path / "ok.pdf").read_bytes()
    (tmp_path / "ok.pdf").write_bytes(re.sub(rb"startxref\s+\d+", b"startxref\n999", data))  # pypdf repairs it, warning
    (doc,) = read_documents(tmp_path, max_file_bytes=200_000)
    assert doc.error_code is None and doc.text.strip() == "Damaged but readable"
    assert any("startxref" in w for w in doc.warnings)
    out, err = capfd.readouterr()
    assert "startxref" not in out + err


def test_result_log_truncates_a_cut_line_and_remembers_done_keys(tmp_path):
    path = tmp_path / "out.jsonl"
    log = ResultLog(path)
    log.append({"custom_id": "a", "response": None, "error": {"code": "x", "message": "m"}})
    log.append({"custom_id": "doc.txt", "content_hash": "sha256:1", "response": {}, "error": None})
    log.close()
    with open(path, "ab") as f:  # a kill in the middle of a write
        f.write(b'{"custom_id": "b", "respo')
    log = ResultLog(path)
    assert log.repaired_bytes == len(b'{"custom_id": "b", "respo')
    assert log.done == {"a", "doc.txt@sha256:1"}
    log.append({"custom_id": "b", "response": {}, "error": None})
    log.close()
    lines = path.read_bytes().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "doc.txt", "b"]
    path.write_text("not a record\n")
    with pytest.raises(InputError, match="line 1"):
        ResultLog(path)
    assert os.path.getsize(path) == len("not a record\n")


@pytest.mark.parametrize("line,message", [
    ("{", "not JSON"),
    ("[]", "JSON object"),
    ('{"method": "POST", "url": "/v1/chat/completions", "body": {}}', "custom_id"),
    ('{"custom_id": "x", "method": "GET", "url": "/v1/chat/completions", "body": {}}', "method must be POST"),
    ('{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}', "url must be one of"),
    ('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": 3}', "body must be"),
])
def test_bad_batch_lines_name_the_line(line, message):
    with pytest.raises(InputError, match=message) as exc:
        parse_input_line(line, 7)
    assert "line 7" in str(exc.value)


def image_bytes(image, fmt: str, **kw) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def write_image_folder(root):
    """Image files of every accepted type and alpha variant, a PDF of two images only (Pillow's PDF writer), a
    PDF with text and an RGBA image (matplotlib, whose image pypdf gives back as PNG with its soft mask), a
    corrupt PNG; returns the pixels each lossless image must decode to."""
    import matplotlib
    import numpy as np
    from PIL import Image

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(7)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (30, 50, 4), dtype=np.uint8), "RGBA")
    la = Image.fromarray(rng.integers(0, 256, (20, 20, 2), dtype=np.uint8), "LA")
    pal = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.info["transparency"] = 3
    (root / "photo.jpg").write_bytes(image_bytes(rgb, "JPEG", quality=90))
    (root / "grey.jpeg").write_bytes(image_bytes(rgb.convert("L"), "JPEG"))
    (root / "alpha.png").write_bytes(image_bytes(rgba, "PNG"))
    (root / "la.png").write_bytes(image_bytes(la, "PNG"))
    (root / "pal.gif").write_bytes(image_bytes(pal, "GIF"))
    (root / "lossless.webp").write_bytes(image_bytes(rgba, "WEBP", lossless=True, exact=True))
    (root / "corrupt.png").write_bytes(image_bytes(rgb, "PNG")[:60])
    rgb.save(root / "scans.pdf", save_all=True, append_images=[la.convert("L")])
    pict = rng.integers(0, 256, (24, 36, 4), dtype=np.uint8)
    fig = plt.figure()
    fig.text(0.1, 0.5, "A chart of sales")
    fig.figimage(pict, 10, 10)
    fig.savefig(root / "report.pdf")
    plt.close(fig)
    return {"alpha.png": np.asarray(rgba), "la.png": np.asarray(la), "lossless.webp": np.asarray(rgba),
            "report.pdf": pict.astype(int)}


def decoded(url: str):
    import base64
    import io

    import numpy as np
    from PIL import Image

    head, _, payload = url.partition(",")
    image = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert head == f"data:image/{image.format.lower()};base64"
    return image, np.asarray(image)


def test_image_documents_with_images_and_without(tmp_path):
    import numpy as np

    want = write_image_folder(tmp_path)
    (tmp_path / "notes.txt").write_text("plain notes")
    docs = {d.custom_id: d for d in read_documents(tmp_path, max_file_bytes=1 << 20, images=True)}
    for name in ("photo.jpg", "grey.jpeg", "alpha.png", "la.png", "pal.gif", "lossless.webp"):
        doc = docs[name]
        assert doc.error_code is None and doc.text == "" and len(doc.images) == 1, name
        image, pixels = decoded(doc.images[0].url)
        if name in want:  # lossless: the pixels Pillow reads back from the file, alpha kept for the compositing
            assert np.array_equal(pixels, want[name]), name
        assert doc.images[0].source == name and doc.images[0].offset == 0
    assert decoded(docs["pal.gif"].images[0].url)[0].info.get("transparency") == 3
    assert docs["corrupt.png"].error_code == "undecodable" and "corrupt.png" in docs["corrupt.png"].error_message
    scans = docs["scans.pdf"]  # images only: a document without text
    assert scans.error_code is None and [decoded(im.url)[0].size for im in scans.images] == [(60, 40), (20, 20)]
    assert [im.offset for im in scans.images] == [0, 2] and scans.content_hash.endswith("+images")
    report = docs["report.pdf"]
    assert report.text.strip() == "A chart of sales"
    (im,) = report.images
    got, pict = decoded(im.url)[1].astype(int), want["report.pdf"]  # matplotlib stores premultiplied colours:
    assert got.shape == pict.shape and np.array_equal(got[..., 3], pict[..., 3])  # exact where alpha is not tiny
    assert np.abs(got - pict)[pict[..., 3] >= 64].max() <= 1 and im.source.startswith("report.pdf page 1 image ")
    assert docs["notes.txt"].images == ()

    plain = {d.custom_id: d for d in read_documents(tmp_path, max_file_bytes=1 << 20)}
    assert set(plain) == {"notes.txt", "scans.pdf", "report.pdf"}  # image files are not documents without --images
    assert plain["report.pdf"].images == () and plain["report.pdf"].text.strip() == "A chart of sales"
    assert plain["scans.pdf"].error_code == "empty_document"
    assert plain["report.pdf"].key != report.key  # read with its images it is another job: resumed separately


def test_pdf_images_go_with_the_chunk_holding_their_page():
    """DocRunner.chunk_images: an image rides with the chunk in which its page's text starts (overlapping chunks:
    the later one that starts at or before it); more images in one chunk than the engine takes is refused."""
    from types import SimpleNamespace

    from moe_export.runtime.entrypoints.batch.doc_tasks import DocRunner, RefusedImages

    pages = [" ".join(f"p{n}w{i}" for i in range(40)) for n in range(3)]
    text = "\n\n".join(pages)
    offsets = [0, len(pages[0]) + 2, len(pages[0]) + len(pages[1]) + 4]
    assert [text[o:o + 4] for o in offsets] == ["p0w0", "p1w0", "p2w0"]
    chunks = chunk_text(text, word_count, 30, 5)
    runner = object.__new__(DocRunner)
    runner.vision = SimpleNamespace(max_images=2)
    images = [{"url": f"u{n}", "source": f"doc.pdf page {n + 1} image I{k}", "offset": o}
              for n, o in enumerate(offsets) for k in range(1 + (n == 2))]
    per_chunk = runner.chunk_images("doc.pdf", text, chunks, images)
    assert sum(map(len, per_chunk)) == len(images)
    for group, chunk in zip(per_chunk, chunks):  # each image's page starts inside its chunk
        assert all(text[im["offset"]:im["offset"] + 4] in chunk.split() for im in group)
    where = {im["url"]: i for i, group in enumerate(per_chunk) for im in group}
    assert [im["url"] for im in per_chunk[0]] == ["u0"] and 0 < where["u1"] < where["u2"] < len(chunks)
    runner.vision = SimpleNamespace(max_images=1)
    with pytest.raises(RefusedImages, match="2 images in one request") as exc:
        runner.chunk_images("doc.pdf", text, chunks, images)
    assert exc.value.code == "too_many_images" and "page 3 image I1" in str(exc.value)


def test_a_malformed_line_keeps_its_readable_custom_id_and_an_output_folder_is_refused(tmp_path):
    from moe_export.runtime.entrypoints.batch.openai_batch import custom_id_of

    assert custom_id_of('{"custom_id": "req-7", "method": "POST", "body": {"messages": [') == "req-7"
    assert custom_id_of('{"custom_id": "a\\"b",, }') == 'a"b'
    assert custom_id_of("not json at all") is None
    with pytest.raises(InputError, match="is a folder; give the output file's path"):
        ResultLog(tmp_path)


def test_a_failing_request_is_its_error_line_and_the_next_succeeds(tmp_path):
    """Fault injection on batch's in-process endpoints (a fake engine): the failed request is an error line
    (500 for it alone), a seed beyond 64 bits a 400 naming the field, and the items after them succeed."""
    import asyncio

    from conftest import write_engine_config
    from fake_llm import FakeLLM
    from moe_export.common.errors import RequestFailed
    from moe_export.runtime.entrypoints.batch.replica import ItemProcessor

    write_engine_config(tmp_path)
    llm = FakeLLM()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    items = [{"kind": "openai", "custom_id": f"c{i}", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate([chat, chat, {**chat, "seed": 1 << 64}, chat])]

    async def run():
        processor = ItemProcessor(llm, str(tmp_path), 4096, None, 1)
        records = []
        for i, item in enumerate(items):
            llm.fail_next = RequestFailed("the grammar of this request failed") if i == 1 else None
            records.append(await processor.process(item))
        await processor.aclose()
        return records

    ok0, failed, bad_seed, ok3 = asyncio.run(run())
    assert ok0["error"] is None and ok3["error"] is None and ok3["response"]["status_code"] == 200
    assert failed["response"]["status_code"] == 500 and failed["error"]["code"] == "server_error"
    assert "RequestFailed" in failed["error"]["message"]
    assert bad_seed["response"]["status_code"] == 400 and "seed" in bad_seed["error"]["message"]


@pytest.mark.parametrize("args, message", [
    (["--task", "summarize", "--reasoning-effort", "ultra"], "--reasoning-effort must be low, high, max, none"),
    (["--task", "summarize", "--overlap", "-1"], "--overlap must be >= 0"),
    (["--task", "summarize", "--max-chunks", "0"], "--max-chunks must be >= 1"),
    (["--task", "summarize", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--task", "summarize", "--max-file-bytes", "0"], "--max-file-bytes must be >= 1"),
    (["--task", "summarize", "--ray", "auto", "--ray-actors", "0"], "--ray-actors must be >= 1"),
    (["--task", "summarize", "--overlap", "100000"], "need more than the overlap (100000)"),
])
def test_every_batch_option_is_checked_before_the_engine_loads_or_the_output_is_touched(tmp_path, capsys, args, message):
    """An engine folder with its config and tokenizer but no engine: a refused option exits 2 naming it, and the
    output (an earlier run's line in it) is left exactly as it was, so no item is marked as failed."""
    from conftest import run_cli, write_engine_config
    from moe_export.export.convert.synth import write_synthetic_tokenizer

    engine = tmp_path / "engine"
    engine.mkdir()
    write_engine_config(engine)
    write_synthetic_tokenizer(engine, "k3", 576)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Alice met Bob.")
    out = tmp_path / "out.jsonl"
    earlier = b'{"id":"x","custom_id":"b.txt","content_hash":"sha256:00","response":null,"error":{"code":"c","message":"m"}}\n'
    out.write_bytes(earlier + b'{"id":"y","custom_id":"cut')  # and a line cut by a kill: left too
    code, _, err = run_cli(capsys, "batch", str(engine), "--input", str(docs), "--output", str(out), *args)
    assert code == 2 and message in " ".join(err.split()) and "Traceback" not in err, err
    assert out.read_bytes() == earlier + b'{"id":"y","custom_id":"cut'


def test_a_changed_document_replaces_its_line_and_other_types_are_counted(tmp_path):
    from moe_export.runtime.entrypoints.batch.runner import collect_items

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("first version")
    (docs / "b.md").write_text("unchanged")
    (docs / "sheet.csv").write_text("1,2")
    (docs / "notes.docx").write_bytes(b"PK")
    out = tmp_path / "out.jsonl"
    log = ResultLog(out)
    pending, _, _, replaced = collect_items(docs, log, 1 << 20)
    assert replaced == 0
    for item in pending:
        log.append({"id": item["custom_id"], "custom_id": item["custom_id"], "content_hash": item["content_hash"],
                    "response": None, "error": {"code": "failed", "message": "injected"}})
    log.close()
    (docs / "a.txt").write_text("second version")
    log = ResultLog(out)
    pending, _, skipped, replaced = collect_items(docs, log, 1 << 20)
    log.close()
    assert [p["custom_id"] for p in pending] == ["a.txt"] and replaced == 1 and len(skipped) == 1
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["b.md"]  # a.txt's old line gone
    assert [p.name for p in files_of_other_types(docs)] == ["notes.docx", "sheet.csv"]
