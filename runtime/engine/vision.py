"""The engine's vision tower: ONNX Runtime over `vision.onnx`, an embedding cache by content hash, and the image
processor the engine ships (`preprocessor_config.json`, with the patch limit the build recorded in config.json).

The tower is replicated: under mpiexec the images of a call are spread over the ranks of rank 0's attention
group (`encode_spread`: image i on group rank i mod tp, data-parallel as vLLM / SGLang run the ViT when its
heads do not divide tp) and the embeddings gathered on rank 0; in one process one session encodes them all.
The tower itself is ONNX Runtime over `vision.onnx`, or the TensorRT runner's tower engine
(`runtime.engine.tensorrt_vision.TensorRTTower`, passed as `tower`). The cache keeps the
projected embeddings of recent images (LRU, bounded in bytes) keyed by `PreparedImage.digest` (sha256 of the
encoded bytes and the processor config), so an image sent again costs no tower call.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
from moe_export.common.engine_config import EngineConfig
from moe_export.common.errors import InputError
from moe_export.graphs.vision import vision_config
from moe_export.graphs.vision_export import VISION_GRAPH, tower_inputs
from moe_export.runtime.images import ImageProcessor, PreparedImage

DEFAULT_CACHE_BYTES = 256 * 2**20


class VisionEncoder:
    """The processor, limits and embedding cache of an engine's tower; `tower(feeds) -> image_embeds` runs it
    (default: ONNX Runtime over `vision.onnx` with `threads` intra-op threads)."""

    def __init__(self, engine_dir: Path, config: EngineConfig, threads: int, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 tower=None) -> None:
        cfg = config.model
        self.vc = vision_config(cfg)
        if self.vc is None:
            raise InputError(f"{engine_dir}: {VISION_GRAPH} present but config.json has no vision_config")
        recipe = config.recipe
        self.processor = ImageProcessor.from_folder(engine_dir).with_patch_limit(config.memory.image_patch_limit)
        self.max_images = recipe.limits.max_images_per_request
        self.tower = tower if tower is not None else _onnxruntime_tower(engine_dir / VISION_GRAPH, threads)
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.cache_bytes, self.max_cache_bytes = 0, cache_bytes
        self.hits = self.misses = 0

    def run(self, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> list[np.ndarray]:
        """One tower call over images given as (pixel_values [patches, 3, p, p], grid): their embeddings."""
        if not items:
            return []
        feeds = tower_inputs(self.vc, np.concatenate([pv for pv, _ in items]), [tuple(g) for _, g in items])
        out = self.tower(feeds)
        sizes = [(h // 2) * (w // 2) for _, (_, h, w) in items]
        return np.split(out, np.cumsum(sizes)[:-1])

    def lookup(self, images: list[PreparedImage]) -> tuple[dict[str, np.ndarray], list[PreparedImage]]:
        """Cached embeddings by digest, and the distinct images still to encode."""
        found, missing = {}, {}
        for im in images:
            if im.digest in self.cache:
                self.cache.move_to_end(im.digest)
                found[im.digest] = self.cache[im.digest]
                self.hits += 1
            elif im.digest not in missing:
                missing[im.digest] = im
                self.misses += 1
        return found, list(missing.values())

    def cached(self, digest: str) -> bool:
        """Whether the embeddings of the image with this digest are cached (its bytes then need no decode)."""
        return digest in self.cache

    def store(self, digest: str, embeds: np.ndarray) -> None:
        if not digest or embeds.nbytes > self.max_cache_bytes:
            return
        self.cache[digest] = embeds
        self.cache_bytes += embeds.nbytes
        while self.cache_bytes > self.max_cache_bytes:
            self.cache_bytes -= self.cache.popitem(last=False)[1].nbytes

    def clear_cache(self) -> None:
        self.cache.clear()
        self.cache_bytes = 0

    def stats(self) -> dict:
        return {"cached_images": len(self.cache), "cache_bytes": self.cache_bytes, "hits": self.hits, "misses": self.misses}


def _onnxruntime_tower(graph: Path, threads: int):
    """`feeds -> image_embeds` over an ONNX Runtime session of the tower graph."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.enable_cpu_mem_arena = False
    session = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(["image_embeds"], feeds)[0]


def encode_spread(vision: VisionEncoder, items: list, group) -> list[np.ndarray]:
    """Embeddings of `items` ((pixel_values, grid) each) spread over an attention group (an MPI communicator
    of its ranks, or None for one process): group rank r encodes images i with i mod size == r, the group's
    first rank gathers them in order (the others return [])."""
    if group is None or group.Get_size() == 1:
        return vision.run(items)
    size, me = group.Get_size(), group.Get_rank()
    mine = vision.run([it for i, it in enumerate(items) if i % size == me])
    parts = group.gather(mine, root=0)
    if parts is None:
        return []
    return [parts[i % size][i // size] for i in range(len(items))]
