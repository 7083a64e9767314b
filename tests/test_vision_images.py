"""Image preprocessing (runtime/images.py): the `<|media_pad|>` count against the public formula for 12 sizes,
the token-limit loop, chessboard compositing, padding, patch order, decoding errors and the media tokens."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
from moe_export.common.errors import InputError
from moe_export.runtime.images import (
    K3_MEDIA_PROC,
    MEDIA_BEGIN,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    ImageProcessor,
    data_url_bytes,
    decode_image,
    image_token_ids,
)
from PIL import Image


def one_pass(w: int, h: int, limit: int, side: int = 512, p: int = 14) -> int:
    """k3-vision.md §3 / vLLM `navit_resize_image`: scale = min(1, sqrt(limit / ((W//14)(H//14))), 512*14/W,
    512*14/H), int(W*s) x int(H*s), padded to multiples of 28, tokens = (H'/28)(W'/28)."""
    s = min(1.0, math.sqrt(limit / (max(1, w // p) * max(1, h // p))), side * p / w, side * p / h)
    nw, nh = max(1, int(w * s)), max(1, int(h * s))
    return math.ceil(nh / 28) * math.ceil(nw / 28)


def public_formula(w: int, h: int, limit: int = 65536) -> int:
    """The checkpoint processor's `get_resize_config`: while the tokens exceed in_patch_limit / 4, lower the
    limit to min(limit - 1, int(limit * max_tokens / tokens)) and recompute."""
    cap, lim = limit // 4, limit
    while (n := one_pass(w, h, lim)) > cap:
        lim = min(lim - 1, int(lim * cap / n))
    return n


SIZES = [  # (W, H): small, ordinary, at / above / far above the patch limit, tall and wide extremes
    (1, 1), (13, 13), (448, 448), (640, 480), (1920, 1080), (3584, 3584), (3600, 3600), (4000, 3000),
    (20000, 20000), (64, 9000), (9000, 64), (20000, 30),
]


@pytest.mark.parametrize("w,h", SIZES)
def test_media_pad_count_equals_public_formula(w, h):
    plan = ImageProcessor().plan(w, h)
    assert plan.num_tokens == public_formula(w, h)
    assert plan.new_width <= w and plan.new_height <= h  # never upscaled
    assert (plan.new_width + plan.pad_width) % 28 == 0 and (plan.new_height + plan.pad_height) % 28 == 0
    assert plan.num_tokens <= 65536 // 4


def test_public_examples():
    proc = ImageProcessor()
    assert proc.plan(1920, 1080).grid == (1, 78, 138) and proc.plan(1920, 1080).num_tokens == 2691
    assert proc.plan(4000, 3000).num_tokens == 15444
    assert proc.plan(3584, 3584).num_tokens == 16384  # exactly at the limit: 256 x 256 patches
    # just above it one pass rounds up past the cap (129 x 129 tokens); the processor's loop brings it back
    assert one_pass(3600, 3600, 65536) == 16641 and proc.plan(3600, 3600).num_tokens == 16384


def test_token_limit_loop_lowers_the_limit():
    # 640x480 under a limit of 100 patches: the first pass gives 6x5 = 30 tokens > 25, so the loop lowers the limit
    proc = ImageProcessor.from_dict({**K3_MEDIA_PROC, "in_patch_limit": 100})
    assert one_pass(640, 480, 100) == 30
    plan = proc.plan(640, 480)
    assert plan.num_tokens == public_formula(640, 480, limit=100) <= 25
    assert ImageProcessor().with_patch_limit(100).plan(640, 480) == plan


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def test_transparent_pixels_are_composited_over_the_chessboard():
    rgba = np.zeros((28, 28, 4), dtype=np.uint8)  # fully transparent, black
    rgba[0, 0] = (200, 0, 0, 128)  # half transparent red over a white square
    rgba[0, 9] = (200, 0, 0, 255)  # opaque red over a gray square
    proc = ImageProcessor()
    pixels = proc.pixels(Image.fromarray(rgba, "RGBA"), proc.plan(28, 28))
    assert pixels[1, 1].tolist() == [255, 255, 255] and pixels[1, 9].tolist() == [180, 180, 180]  # 8 px squares
    assert pixels[9, 9].tolist() == [255, 255, 255] and pixels[9, 1].tolist() == [180, 180, 180]
    a = np.float32(128) / np.float32(255)
    assert pixels[0, 0].tolist() == [int(a * 200 + (1 - a) * 255), int((1 - a) * 255), int((1 - a) * 255)]  # 227, 127, 127
    assert pixels[0, 9].tolist() == [200, 0, 0]


def test_rgb_untouched_padding_zero_and_patch_order():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (30, 44, 3), dtype=np.uint8)
    prep = ImageProcessor().preprocess(Image.fromarray(rgb))
    assert prep.plan.grid == (1, 4, 4) and prep.num_tokens == 4
    x = prep.pixel_values
    assert x.shape == (16, 3, 14, 14) and x.dtype == np.float32
    # patch k is grid cell (k // 4, k % 4), channels first, normalized (v / 255 - 0.5) / 0.5
    r, c = 1, 2
    want = (rgb[14 * r:14 * r + 14, 14 * c:14 * c + 14].astype(np.float32) / 255 - 0.5) / 0.5
    assert np.allclose(x[r * 4 + c], want.transpose(2, 0, 1), atol=1e-6)
    assert np.all(x[15, :, 14 - 12:, :] == -1.0)  # zero padding below row 30 -> -1 after normalization


def test_decoding_errors_name_the_part():
    with pytest.raises(InputError, match=r"content\[1\]: not a readable image"):
        decode_image(b"not an image", "messages[0].content[1]")
    with pytest.raises(InputError, match="unsupported image type 'BMP'"):
        decode_image(_png(Image.new("RGB", (4, 4)), "BMP"), "part")
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    gif = decode_image(buf.getvalue(), "part")
    assert gif.convert("RGB").getpixel((0, 0)) == (255, 0, 0)  # the first frame
    url = "data:image/png;base64," + base64.b64encode(_png(Image.new("RGB", (2, 2)))).decode()
    assert decode_image(data_url_bytes(url, "part"), "part").size == (2, 2)
    for bad, match in (("http://x/a.png", "only data:image"), ("data:text/plain;base64,AAAA", "data:image/"),
                       ("data:image/png;base64,@@@", "not valid base64")):
        with pytest.raises(InputError, match=match):
            data_url_bytes(bad, "part")


def test_image_tokens(tmp_path):
    from moe_export.export.convert.synth import write_synthetic_tokenizer
    from moe_export.runtime.tokenizer import load_tokenizer

    write_synthetic_tokenizer(tmp_path, "k3", 4096)
    tok = load_tokenizer(tmp_path)
    ids = image_token_ids(tok, 1920, 1080, 3)
    specials = [tok.encode_special(n) for n in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END)]
    assert ids[0] == specials[0] and ids[-1] == specials[3] and ids[-4:-1] == [specials[2]] * 3
    assert tok.decode(ids) == f"{MEDIA_BEGIN}image 1920x1080{MEDIA_CONTENT}{MEDIA_PAD * 3}{MEDIA_END}"
