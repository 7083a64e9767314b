"""Image prompts on built engines against the fp32 reference (KimiModel + VisionTower): one image and three
images of different sizes (one transparent), greedy tokens and prefill logits, 1 and 4 ranks in process and 4
under mpiexec; prefill chunks splitting an image's rows; session reuse only with the same images; the
embedding cache; refusals (no tower, bad images, too many images)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from moe_export.export.convert.checkpoint import load_model
from moe_export.common.errors import InputError
from moe_export.graphs.vision import VisionTower, vision_config
from moe_export.runtime import LLM, SamplingParams
from moe_export.runtime.engine.batch import SequenceChunk, StepBatch
from moe_export.runtime.images import PromptImages
from PIL import Image

from fp32_reorder import num_layers, reorder_atol

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def picture(seed: int, h: int, w: int, alpha: bool = False) -> Image.Image:
    rng = np.random.default_rng(seed)
    if not alpha:
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    rgba[..., 3] = np.where(rng.random((h, w)) < 0.4, 0, rgba[..., 3])
    return Image.fromarray(rgba, "RGBA")


def chat(*images: Image.Image, text: str = "Describe the pictures.") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": parts}]


ONE = chat(picture(0, 60, 90))
THREE = chat(picture(1, 100, 150), picture(2, 70, 50, alpha=True), picture(3, 30, 300))


@pytest.fixture(scope="module")
def reference(synthetic_checkpoint):
    from moe_export.export.convert.checkpoint import open_checkpoint

    ck = synthetic_checkpoint("tiny-k3")
    with open_checkpoint(ck) as reader:
        tower = VisionTower.from_source(reader, vision_config(reader.config))
    return load_model(ck), tower


def reference_run(reference, llm: LLM, messages: list[dict], prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and prefill logits of the reference on the engine's prompt ids, with the reference tower's
    embeddings of the same preprocessed images at the `<|media_pad|>` rows."""
    model, tower = reference
    images = PromptImages(llm.tokenizer, llm.engine.vision.processor, messages)
    for where in images.parts:
        images.expand(where)
    pv = torch.from_numpy(np.concatenate([im.pixel_values for im in images.order]))
    embeds = tower(pv, torch.tensor([im.plan.grid for im in images.order]))
    ids = torch.tensor([prompt_ids])
    mask = ids == llm.engine.media_pad_id
    assert int(mask.sum()) == embeds.shape[0]
    cache = model.new_cache(1)
    logits = model.forward(ids, cache, embeds, mask)[0, -1]
    first = logits
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = model.decode(torch.tensor([tok]), cache)[0]
    return out, first


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 2, 4)], ids=["world1", "world4"])
@pytest.mark.parametrize("messages", [ONE, THREE], ids=["one_image", "three_images"])
def test_image_chat_equals_reference(runtime_engine, reference, layout, messages):
    llm = LLM(runtime_engine("tiny-k3", *layout))
    out = llm.chat([messages], GREEDY, reasoning_effort="none")[0]
    pads = out.prompt_ids.count(llm.engine.media_pad_id)
    assert pads == sum(im.num_tokens for im in PromptImages(llm.tokenizer, llm.engine.vision.processor, messages).parts.values())
    want, ref_logits = reference_run(reference, llm, messages, out.prompt_ids, len(out.output_ids))
    assert out.output_ids == want
    # prefill logits of the engine itself, one step over the whole prompt
    seq = llm._root().engine_core.check(_request(llm, messages))
    llm.engine.reset_slot(0)
    n = llm.engine.max_num_tokens = len(out.prompt_ids)  # the whole prompt in one step
    blocks = list(range(-(-n // llm.engine.block_size)))
    embeds = llm.engine.encode_images([[im.pixel_values, list(im.plan.grid)] for im in seq.request.images])
    chunk = SequenceChunk(0, 0, out.prompt_ids, blocks, seq.pad_positions.tolist(), np.concatenate(embeds))
    logits = llm.engine.step(StepBatch.from_sequences([chunk], llm.engine.image_width))[0]
    want = ref_logits.numpy()
    # float32 in another summation order: the text layers and, through the image rows, the tower's layers
    depth = num_layers(llm.engine.model_config) + reference[1].vc.num_layers
    assert np.abs(logits - want).max() <= reorder_atol(want, depth, llm.engine.max_seq_len)


def _request(llm: LLM, messages: list[dict]):
    from moe_export.runtime.core.scheduler import Request

    tracked = llm.prepare_chat(messages, GREEDY, reasoning_effort="none")
    return Request("probe", tracked.prompt_ids, GREEDY, images=tracked.images)


def test_prefill_chunks_split_the_image_rows(runtime_engine, reference):
    llm = LLM(runtime_engine("tiny-k3", 1, 1, 1, max_num_tokens=16))
    out = llm.chat([THREE], GREEDY, reasoning_effort="none")[0]
    assert len(out.prompt_ids) > 4 * 16
    assert out.output_ids == reference_run(reference, llm, THREE, out.prompt_ids, len(out.output_ids))[0]


def _run(llm: LLM, request_id: str, ids: list[int], images: list) -> tuple[list[int], int]:
    """One request through the LLM's scheduler: (output ids, prompt tokens taken from a kept session)."""
    from moe_export.runtime.core.scheduler import Request

    sched = llm._root().engine_core
    sched.add(Request(request_id, ids, GREEDY, images=images))
    out, cached = [], 0
    while sched.has_work:
        for u in sched.step():
            out += u.token_ids
            cached = max(cached, u.cached_tokens)
    return out, cached


def test_sessions_reused_only_with_the_same_images_and_the_cache(runtime_engine):
    engine = runtime_engine("tiny-k3", 1, 1, 1)
    llm, fresh = LLM(engine), LLM(engine, reuse_sessions=False)
    first = llm.prepare_chat(ONE, GREEDY, reasoning_effort="none")
    out, cached = _run(llm, "a", first.prompt_ids, first.images)
    assert cached == 0
    more = first.prompt_ids + out + llm.tokenizer.encode(" And the colours?")
    again, cached = _run(llm, "b", more, first.images)
    assert cached == len(first.prompt_ids) + len(out) - 1  # everything the first turn computed
    assert again == _run(fresh, "b", more, first.images)[0]
    assert llm.engine.vision.stats()["misses"] == 1 and llm.engine.vision.stats()["hits"] == 1  # embedding cache
    # the same size, other pixels: the same token ids, but the kept state stops before the image's first row
    other = llm.prepare_chat(chat(picture(9, 60, 90)), GREEDY, reasoning_effort="none")
    assert other.prompt_ids == first.prompt_ids
    swapped, cached = _run(llm, "c", more, other.images)
    assert cached <= first.prompt_ids.index(llm.engine.media_pad_id)
    assert swapped == _run(fresh, "c", more, other.images)[0]


def test_a_cached_image_is_not_decoded_again(runtime_engine, monkeypatch):
    """The embedding cache's hot path: an image whose embeddings are cached is hashed and its header read for
    the plan, never decoded (Pillow's load) nor resized; evicted between admission and the tower call, it is
    decoded then, with the same answer."""
    from PIL import ImageFile

    llm = LLM(runtime_engine("tiny-k3", 1, 1, 1))
    (first,) = llm.chat([ONE], GREEDY, reasoning_effort="none")
    loads = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self.size) or real_load(self))
    hits = llm.engine.vision.stats()["hits"]
    (hot,) = llm.chat([ONE], GREEDY, reasoning_effort="none")
    assert loads == [] and llm.engine.vision.stats()["hits"] == hits + 1
    assert hot.output_ids == first.output_ids and hot.prompt_ids == first.prompt_ids
    tracked = llm.prepare_chat(ONE, GREEDY, reasoning_effort="none")  # admitted as cached, then evicted
    llm.engine.vision.clear_cache()
    assert loads == []
    (evicted,) = llm._collect([tracked])
    assert loads == [(90, 60)] and evicted.output_ids == first.output_ids
    llm.engine.vision.clear_cache()  # cold: decoded when the request is prepared
    llm.chat([ONE], GREEDY, reasoning_effort="none")
    assert len(loads) > 1 and set(loads) == {(90, 60)}


def test_refusals(runtime_engine):
    llm = LLM(runtime_engine("tiny-k3", 1, 1, 1))
    bad = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(InputError, match=r"messages\[0\]\.content\[1\]: not a readable image"):
        llm.chat([bad], GREEDY)
    url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(InputError, match=r"content\[0\]\.image_url: http\(s\) image URLs are off"):
        llm.chat([url], GREEDY)
    many = chat(*[picture(k, 28, 28) for k in range(llm.engine.vision.max_images + 1)])
    with pytest.raises(InputError, match="too many images"):
        llm.chat([many], GREEDY)
    text_only = LLM(runtime_engine("tiny-kimi-linear", 1, 1, 1))
    with pytest.raises(InputError, match="no vision graph"):
        text_only.chat([ONE], GREEDY)


def test_image_chat_under_mpiexec(runtime_engine):
    engine = runtime_engine("tiny-k3", 2, 2, 4)
    inproc = LLM(engine).chat([THREE], GREEDY, reasoning_effort="none")[0]
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    script = str(Path(__file__).with_name("mpi_vision_run.py"))
    r = subprocess.run([mpiexec, "-n", "4", sys.executable, script, str(engine), json.dumps(THREE), str(GREEDY.max_tokens)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"prompt_ids": inproc.prompt_ids, "output_ids": inproc.output_ids}


def test_terminal_image_command(runtime_engine, tmp_path, capsys):
    from moe_export.runtime.entrypoints.terminal import chat_terminal

    path = tmp_path / "p.png"
    picture(4, 60, 90, alpha=True).save(path)
    lines = f"/image {tmp_path / 'missing.png'}\n/image {path}\nWhat is it?\n/exit\n"
    chat_terminal(runtime_engine("tiny-k3", 1, 1, 1), effort="none", flags={"temperature": 0, "max_tokens": 3},
                  stdin=io.StringIO(lines))
    out = capsys.readouterr().out
    assert "missing.png: cannot read" in out and "attached to your next message" in out
    prompt = int(next(line for line in out.splitlines() if line.startswith("(prompt ")).split()[1])
    assert prompt > 12  # 90x60 -> 12 image tokens plus the message


def test_server_image_parts(tmp_path):
    import anthropic
    import openai
    from serve_support import InProcessServer, build_serve_engine

    server = InProcessServer(build_serve_engine(tmp_path))
    try:
        url = data_url(picture(5, 60, 90))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        parts = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], max_tokens=3,
                                           temperature=0, reasoning_effort="none")
        text_only = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is it?"}],
                                                   max_tokens=3, temperature=0, reasoning_effort="none")
        assert r.usage.prompt_tokens - text_only.usage.prompt_tokens >= 12 + 3  # pads, media markers, "image 90x60"
        resp = client.responses.create(model=model, max_output_tokens=3, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": url}]}])
        assert resp.usage.input_tokens > text_only.usage.prompt_tokens + 12
        b64 = url.split(",", 1)[1]
        msg = anthropic.Anthropic(base_url=server.url, api_key="x").messages.create(
            model=model, max_tokens=3, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}])
        u = msg.usage  # Anthropic's prompt total: input + cache creation + cache read
        assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens > text_only.usage.prompt_tokens
        bad = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        with pytest.raises(openai.BadRequestError, match=r"content\[1\]: not a readable image"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": bad}], max_tokens=3)
    finally:
        server.stop()


def test_image_urls_when_allowed(runtime_engine, tmp_path):
    import functools
    import http.server
    import threading

    from moe_export.runtime.images import MAX_IMAGE_BYTES

    picture(6, 60, 90).save(tmp_path / "a.png")
    (tmp_path / "big.png").write_bytes(b"\0" * (MAX_IMAGE_BYTES + 1))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        def ask(url):
            return [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]

        engine = runtime_engine("tiny-k3", 1, 1, 1)
        with pytest.raises(InputError, match="could not be fetched"):  # loopback: refused by default
            LLM(engine, allow_image_urls=True).chat([ask(base + "/a.png")], GREEDY)
        llm = LLM(engine, allow_image_urls=True, allow_private_image_urls=True)
        by_url = llm.chat([ask(base + "/a.png")], GREEDY, reasoning_effort="none")[0]
        inline = llm.chat([ask(data_url(Image.open(tmp_path / "a.png")))], GREEDY, reasoning_effort="none")[0]
        assert by_url.prompt_ids == inline.prompt_ids and by_url.output_ids == inline.output_ids
        with pytest.raises(InputError, match="could not be fetched"):  # a 404
            llm.chat([ask(base + "/missing.png")], GREEDY)
        with pytest.raises(InputError, match="could not be fetched"):  # over the size cap
            llm.chat([ask(base + "/big.png")], GREEDY)
        with pytest.raises(InputError, match="URLs are off"):
            LLM(engine).chat([ask(base + "/a.png")], GREEDY)
    finally:
        server.shutdown()
