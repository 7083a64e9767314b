"""Image input for K3: decoding, preprocessing (Pillow, on CPU) and the prompt's media tokens.

The rules are the checkpoint image processor's (`k3-vision.md` §3; vLLM `models/kimi_k3/common/mm_preprocess.py`
`navit_resize_image`, the K3 `image_processing` `get_resize_config` loop and `_fill_transparent_bg`, SGLang
`processors/kimi_k25.py` patchify):

  plan      scale = min(1, sqrt(limit / ((W//p)(H//p))), side*p/W, side*p/H) (never upscaled); the image is
            resized to int(W*s) x int(H*s) (at least 1, at most side*p), then zero-padded bottom / right to a
            multiple of 28; tokens = (H'/28)(W'/28). While that exceeds in_patch_limit / 4 the limit is lowered
            to min(limit - 1, int(limit * max_tokens / tokens)) and the plan recomputed.
  resize    bicubic, in the image's own mode (`transparent_bg_fill_stage` "after_resize")
  alpha     an RGB image is left alone; one with an alpha band (or a palette transparency) is composited
            over a chessboard (8 px squares, top-left white 255, others 180): float32 alpha / 255,
            alpha * rgb + (1 - alpha) * board, truncated to uint8; other modes are converted to RGB
  pixels    / 255, (x - 0.5) / 0.5, patches in (t, gh, gw, C, p, p) order -> [gh*gw, 3, p, p] fp32

The number of tokens of an image is known from its size alone (`ImageProcessor.plan`), before any pixel is
touched, so admission can count an image's `<|media_pad|>` rows first.

Prompt expansion: each `<|kimi_image_placeholder|>` becomes `<|media_begin|>image {W}x{H}<|media_content|>`,
tokens x `<|media_pad|>`, `<|media_end|>`, W x H the original size; only the pad rows take image embeddings.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from moe_export.common.errors import InputError
from moe_export.common.model_config import read_json_object
from moe_export.graphs.tokens import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD
from moe_export.graphs.vision import K3_MEDIA_PROC, PREPROCESSOR_CONFIG
from PIL import Image, UnidentifiedImageError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what image parts may carry
MAX_IMAGE_BYTES = 32 * 2**20
MAX_IMAGE_PIXELS = 64 * 2**20  # larger decoded images are refused (decompression bombs)


@dataclass(frozen=True)
class ResizePlan:
    """Where an image of `width` x `height` goes: resized size, padding, patch grid and merged tokens."""

    width: int
    height: int
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    patch_size: int

    @property
    def grid(self) -> tuple[int, int, int]:
        """(t, h, w) in patches."""
        p = self.patch_size
        return 1, (self.new_height + self.pad_height) // p, (self.new_width + self.pad_width) // p

    @property
    def num_patches(self) -> int:
        _, h, w = self.grid
        return h * w

    @property
    def num_tokens(self) -> int:
        _, h, w = self.grid
        return (h // 2) * (w // 2)


def navit_plan(width: int, height: int, patch_size: int, merge: int, limit: int, side: int) -> ResizePlan:
    """One pass of the public `navit_resize_image` rule (no token-limit loop)."""
    s_total = math.sqrt(limit / (max(1.0, width // patch_size) * max(1.0, height // patch_size)))
    scale = min(1.0, s_total, side * patch_size / width, side * patch_size / height)
    new_w = min(max(1, int(width * scale)), side * patch_size)
    new_h = min(max(1, int(height * scale)), side * patch_size)
    factor = merge * patch_size
    return ResizePlan(width, height, new_w, new_h, (factor - new_w % factor) % factor,
                      (factor - new_h % factor) % factor, patch_size)


@dataclass
class PreparedImage:
    """One image of a request: its plan (tokens known from the size alone), its content hash, and its
    pixel_values [patches, 3, p, p] fp32, computed from the decoded image on first use (an image whose
    embeddings are cached is never resized)."""

    plan: ResizePlan
    digest: str
    image: Image.Image | None = None
    processor: ImageProcessor | None = None
    pixels: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def pixel_values(self) -> np.ndarray:
        if self.pixels is None:
            self.pixels = self.processor.pixel_values(self.image, self.plan)
            self.image = None
        return self.pixels


@dataclass
class ImageProcessor:
    """The checkpoint's `media_proc_cfg` (K3's values for any key it does not set)."""

    cfg: dict[str, Any] = field(default_factory=lambda: dict(K3_MEDIA_PROC))

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageProcessor:
        """Read `preprocessor_config.json` (its `media_proc_cfg`, or top-level keys) if the folder has one."""
        path = Path(folder) / PREPROCESSOR_CONFIG
        cfg = dict(K3_MEDIA_PROC)
        if path.is_file():
            raw = read_json_object(path)
            cfg.update(raw.get("media_proc_cfg", {k: v for k, v in raw.items() if k in K3_MEDIA_PROC}))
        return cls.from_dict(cfg, str(path))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = PREPROCESSOR_CONFIG) -> ImageProcessor:
        cfg = dict(cfg)
        merge = cfg.get("merge_kernel_size")
        if isinstance(merge, (list, tuple)):
            if len(set(merge)) != 1:
                raise InputError(f"{source}: merge_kernel_size must be square, got {merge!r}")
            cfg["merge_kernel_size"] = merge[0]
        for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            val = cfg.get(key)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise InputError(f"{source}: media_proc_cfg.{key} must be a positive integer, got {val!r}")
        for key in ("image_mean", "image_std"):
            val = cfg.get(key)
            if not (isinstance(val, list) and len(val) == 3 and all(isinstance(v, (int, float)) for v in val)):
                raise InputError(f"{source}: media_proc_cfg.{key} must be three numbers, got {val!r}")
        if cfg.get("transparent_bg_fill_stage", "before_resize") not in ("before_resize", "after_resize"):
            raise InputError(f"{source}: media_proc_cfg.transparent_bg_fill_stage must be 'before_resize' or 'after_resize'")
        bg = cfg.get("transparent_bg_config")
        if bg is not None and bg.get("pattern") not in ("chessboard", "white", "black", "gray"):
            raise InputError(f"{source}: transparent_bg_config.pattern must be chessboard, white, black or gray")
        return cls(cfg)

    def with_patch_limit(self, limit: int | None) -> ImageProcessor:
        """This processor with `in_patch_limit` lowered to `limit` (the recipe's `limits.max_image_patches`)."""
        if limit is None or limit >= self.cfg["in_patch_limit"]:
            return self
        return ImageProcessor({**self.cfg, "in_patch_limit": limit})

    @property
    def patch_size(self) -> int:
        return self.cfg["patch_size"]

    @property
    def max_tokens(self) -> int:
        """The most merged tokens one image can take: in_patch_limit / merge^2."""
        return self.cfg["in_patch_limit"] // self.cfg["merge_kernel_size"] ** 2

    def plan(self, width: int, height: int) -> ResizePlan:
        """The resize plan of a `width` x `height` image, with the processor's token-limit loop."""
        c = self.cfg
        limit = c["in_patch_limit"]
        while True:
            plan = navit_plan(width, height, c["patch_size"], c["merge_kernel_size"], limit, c["patch_limit_on_one_side"])
            if plan.num_tokens <= self.max_tokens:
                return plan
            limit = min(limit - 1, int(limit * self.max_tokens / plan.num_tokens))

    def fill_transparent(self, image: Image.Image) -> Image.Image:
        """RGB as is; an image with alpha composited over the configured background; others converted to RGB."""
        bg_cfg = self.cfg.get("transparent_bg_config")
        if bg_cfg is None:
            return image.convert("RGB")
        if image.mode == "RGB":
            return image
        if "A" not in image.getbands() and "transparency" not in image.info:
            return image.convert("RGB")
        rgba = np.asarray(image.convert("RGBA"))
        h, w = rgba.shape[:2]
        board = background(h, w, bg_cfg)
        alpha = (rgba[:, :, 3].astype(np.float32) / 255.0)[:, :, None]
        return Image.fromarray((alpha * rgba[:, :, :3] + (1 - alpha) * board).astype(np.uint8))

    def pixels(self, image: Image.Image, plan: ResizePlan) -> np.ndarray:
        """The resized, composited, zero-padded uint8 [H', W', 3] array of `image`."""
        after = self.cfg.get("transparent_bg_fill_stage", "before_resize") == "after_resize"
        if not after:
            image = self.fill_transparent(image)
        image = image.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
        if after:
            image = self.fill_transparent(image)
        arr = np.asarray(image.convert("RGB"))
        return np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))

    def pixel_values(self, image: Image.Image, plan: ResizePlan) -> np.ndarray:
        """The normalized patches [gh*gw, 3, p, p] fp32 of `image`, in (gh, gw, C, p, p) order."""
        x = (self.pixels(image, plan) / 255.0).astype(np.float32)
        x -= np.asarray(self.cfg["image_mean"], dtype=np.float32)
        x *= 1.0 / np.asarray(self.cfg["image_std"], dtype=np.float32)
        p = self.patch_size
        _, gh, gw = plan.grid
        return np.ascontiguousarray(x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p))

    def preprocess(self, image: Image.Image, digest: str = "") -> PreparedImage:
        """One image -> PreparedImage with its pixel values computed now."""
        plan = self.plan(*image.size)
        return PreparedImage(plan, digest, pixels=self.pixel_values(image, plan))

    def prepare_bytes(self, data: bytes, where: str, known=None) -> PreparedImage:
        """Decode an encoded image (InputError naming `where` if it cannot be) and plan it; its pixel values are
        computed when the tower needs them. The digest is sha256 of the bytes and this config. `known(digest)`
        true (the embedding cache holds it: these exact bytes were decoded before) skips the decode: the header
        gives the size the plan needs, and the pixels are read only if the tower still needs them."""
        digest = image_digest(data, self.cfg)
        image = open_image(data, where) if known is not None and known(digest) else decode_image(data, where)
        return PreparedImage(self.plan(*image.size), digest, image, self)


def background(h: int, w: int, bg_cfg: dict[str, Any]) -> np.ndarray:
    """The [h, w, 3] uint8 background transparent pixels are composited over."""
    pattern = bg_cfg.get("pattern", "chessboard")
    if pattern != "chessboard":
        return np.full((h, w, 3), {"white": 255, "black": 0, "gray": 128}[pattern], dtype=np.uint8)
    sq = bg_cfg.get("chessboard_square_size", 8)
    odd = ((np.arange(h)[:, None] // sq + np.arange(w)[None, :] // sq) % 2).astype(bool)
    white_first = bg_cfg.get("chessboard_square_on_top_left", True)
    white, gray = bg_cfg.get("chessboard_white_value", 255), bg_cfg.get("chessboard_gray_value", 180)
    board = np.where(odd == white_first, gray, white).astype(np.uint8)
    return np.repeat(board[:, :, None], 3, axis=2)


def image_digest(data: bytes, cfg: dict[str, Any]) -> str:
    """Content hash of an encoded image under a preprocessing config (the embedding cache and session key)."""
    h = hashlib.sha256(repr(sorted(cfg.items())).encode())
    h.update(data)
    return h.hexdigest()


def decode_image(data: bytes, where: str) -> Image.Image:
    """A PIL image from PNG / JPEG / WebP / GIF (first frame) bytes, decoded; InputError naming `where` otherwise."""
    return open_image(data, where, load=True)


def open_image(data: bytes, where: str, load: bool = False) -> Image.Image:
    """A PIL image from PNG / JPEG / WebP / GIF (first frame) bytes, its header checked (type, pixel count) and,
    with `load`, its pixels decoded; InputError naming `where` otherwise."""
    if len(data) > MAX_IMAGE_BYTES:
        raise InputError(f"{where}: image of {len(data)} bytes is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            fmt = image.format
            if fmt not in IMAGE_FORMATS:
                raise InputError(f"{where}: unsupported image type {fmt!r}; supported: PNG, JPEG, WebP, GIF")
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InputError(f"{where}: image of {image.width}x{image.height} pixels exceeds {MAX_IMAGE_PIXELS} pixels")
            image.seek(0)
            if load:
                image.load()
    except InputError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as exc:
        raise InputError(f"{where}: not a readable image ({readable_reason(exc)})") from None
    if image.width < 1 or image.height < 1:
        raise InputError(f"{where}: empty image")
    return image


def readable_reason(exc: BaseException) -> str:
    """Pillow's reason for refusing an image, without the Python reprs it names its input by."""
    if isinstance(exc, UnidentifiedImageError):
        return "not a PNG, JPEG, WebP or GIF file"
    text = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(exc)).strip()
    return text or type(exc).__name__


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; InputError for any other URL."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise InputError(f"{where}: only data:image/...;base64 URLs are accepted here")
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
        raise InputError(f"{where}: a data URL must be data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{where}: the data URL's base64 payload is not valid base64") from None


def image_token_ids(tokenizer, width: int, height: int, num_tokens: int) -> list[int]:
    """`<|media_begin|>image {W}x{H}<|media_content|>` + num_tokens x `<|media_pad|>` + `<|media_end|>`."""
    return ([tokenizer.encode_special(MEDIA_BEGIN)] + tokenizer.encode(f"image {width}x{height}")
            + [tokenizer.encode_special(MEDIA_CONTENT)] + [tokenizer.encode_special(MEDIA_PAD)] * num_tokens
            + [tokenizer.encode_special(MEDIA_END)])


IMAGE_PART_TYPES = ("image", "image_url", "input_image")


def image_part_bytes(part: dict, where: str, fetch_url=None) -> bytes:
    """The encoded image of a content part: OpenAI `image_url` ({"url": data URL} or the URL string),
    Responses `input_image` (`image_url`), Anthropic `image` ({"source": {"type": "base64", "data": ...}});
    http(s) URLs are fetched only with `fetch_url` ((url, where) -> bytes: `runtime.image_urls.fetch_image_url`
    under an address policy)."""
    kind = part.get("type")
    if kind == "image" and isinstance(part.get("source"), dict):
        src = part["source"]
        if src.get("type") != "base64" or not isinstance(src.get("data"), str):
            raise InputError(f"{where}.source: only base64 image sources are accepted")
        media = src.get("media_type", "image/png")
        return data_url_bytes(f"data:{media};base64,{src['data']}", f"{where}.source")
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise InputError(f"{where}: an image part needs image_url.url (a data:image/...;base64 URL)")
    if url.startswith(("http://", "https://")):
        if fetch_url is None:
            raise InputError(f"{where}.image_url: http(s) image URLs are off (the server's --allow-image-urls turns "
                             "them on); send the image as a data:image/...;base64 URL")
        return fetch_url(url, f"{where}.image_url")
    return data_url_bytes(url, f"{where}.image_url")


class PromptImages:
    """The image parts of a conversation, decoded and preprocessed, keyed by their place
    ("messages[i].content[k]"); `expand(where)` gives a part's media tokens and records the order in which the
    prompt holds them (`order`: the images of the prompt's `<|media_pad|>` runs, in order)."""

    def __init__(self, tokenizer, processor: ImageProcessor, messages: list, max_images: int | None = None,
                 fetch_url=None, known=None) -> None:
        self.tokenizer = tokenizer
        self.parts: dict[str, PreparedImage] = {}
        self.order: list[PreparedImage] = []
        for i, msg in enumerate(messages if isinstance(messages, list) else []):
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list):
                continue
            for k, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    where = f"messages[{i}].content[{k}]"
                    if max_images is not None and len(self.parts) >= max_images:
                        raise InputError(f"{where}: too many images: the engine takes at most {max_images} per request "
                                         "(limits.max_images_per_request)")
                    self.parts[where] = processor.prepare_bytes(image_part_bytes(part, where, fetch_url), where, known)

    def expand(self, where: str) -> list[int]:
        image = self.parts[where]
        self.order.append(image)
        plan = image.plan
        return image_token_ids(self.tokenizer, plan.width, plan.height, plan.num_tokens)


def image_file_part(path: str) -> dict:
    """An OpenAI `image_url` part (a base64 data URL) for an image file; InputError if it is not a readable
    PNG / JPEG / WebP / GIF."""
    if not path:
        raise InputError("/image needs a file path")
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    fmt = decode_image(data, path).format.lower()
    return {"type": "image_url", "image_url": {"url": f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"}}
