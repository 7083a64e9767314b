"""The torch runner's vision tower: K3's MoonViT + projector (`graphs.vision.VisionTower`; bf16 on a GPU, fp32 on CPU) over the engine's
`vision.safetensors` on the rank's device, behind `vision.VisionEncoder`'s `tower(feeds) -> image_embeds` hook
(the processor, the patch limit, the embedding cache and the spread over an attention group stay the encoder's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from moe_export.common.engine_config import EngineConfig
from moe_export.graphs.vision import VISION_NORM_EPS, VisionTower, vision_config


def grids_from_feeds(feeds: dict[str, np.ndarray]) -> list[tuple[int, int, int]]:
    """The (t, h, w) patch grid of each image of a tower call (`vision_export.tower_inputs`' feeds): h * w from the
    image's patch offsets, w from its first merged token's rows (top-left and bottom-left patches, w apart)."""
    cu, merge = feeds["cu_seqlens"], feeds["merge_index"]
    grids, row = [], 0
    for n in range(cu.shape[0] - 1):
        patches = int(cu[n + 1] - cu[n])
        w = int(merge[row, 2] - merge[row, 0])
        grids.append((1, patches // w, w))
        row += (patches // w // 2) * (w // 2)
    return grids


class TorchTower:
    """`feeds -> image_embeds` [M, hidden] fp32 (host) over the reference tower (`tower`) on `device`: bf16
    weights and activations on a GPU, fp32 on CPU (the ONNX Runtime tower's arithmetic)."""

    def __init__(self, weights_path: Path, config: EngineConfig, device: torch.device) -> None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        weights = {k: v.to(device=device, dtype=dtype) for k, v in load_file(str(weights_path)).items()}
        self.device = device
        self.tower = VisionTower(vision_config(config.model), weights,
                                 VISION_NORM_EPS[config.recipe.vision.rms_norm_eps])

    def embed(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [L, 3, p, p] on the device, each image's (t, h, w) -> embeddings [M, hidden] on the device."""
        return self.tower(pixels, torch.tensor(grids, dtype=torch.int64))

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        pixels = torch.from_numpy(feeds["pixel_values"]).to(self.device)
        return self.embed(pixels, grids_from_feeds(feeds)).float().cpu().numpy()
