"""The built-in model's quality yardsticks, offline.

`Judge` is a small CNN trained on rendered scenes to read the main object's shape, colour and
position and the background. Its accuracy on generated images against the caption's attributes
is the "prompt fidelity" (our stand-in for CLIP score); its penultimate features feed torchmetrics'
FID/KID in place of Inception.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .scenes import (
    BACKGROUND_KEYWORDS,
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    SHAPES,
    Scene,
    parse_caption,
)

HEADS = {"shape": len(SHAPES), "colour": len(COLOURS), "background": len(BACKGROUNDS),
         "position": len(POSITIONS)}
FEATURES = 128


class Judge(nn.Module):
    num_features = FEATURES  # read by torchmetrics so it skips its Inception-sized probe

    def __init__(self, heads: tuple[str, ...] = tuple(HEADS)) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1),
                                 nn.BatchNorm2d(cout), nn.ReLU())

        self.body = nn.Sequential(conv(3, 32), conv(32, 64), conv(64, 128), conv(128, FEATURES),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.heads = nn.ModuleDict({k: nn.Linear(FEATURES, HEADS[k]) for k in heads})

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images float [B, 3, 64, 64] in [0, 1] -> [B, 128]."""
        return self.body(images * 2 - 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # torchmetrics' FID/KID call the feature extractor with images in [0, 1] (normalize=True)
        return self.features(images)

    def logits(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.features(images)
        return {k: h(f) for k, h in self.heads.items()}


def images_to_tensor(images: np.ndarray | list) -> torch.Tensor:
    """uint8 [B, 64, 64, 3] (or a list of PIL images) -> float [B, 3, 64, 64] in [0, 1]."""
    arr = np.stack([np.asarray(im.convert("RGB")) if hasattr(im, "convert") else im
                    for im in images])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 255.0


def scene_labels(scenes: list[Scene]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([s.labels[k] for s in scenes]) for k in HEADS}


def heads_in(tensors: dict, prefix: str = "judge.") -> tuple[str, ...]:
    """The heads a saved judge has (weights trained before the position head lack it)."""
    return tuple(k for k in HEADS if f"{prefix}heads.{k}.weight" in tensors)


@torch.no_grad()
def predict(judge: Judge, images) -> dict[str, torch.Tensor]:
    judge.eval()
    return {k: v.argmax(-1) for k, v in judge.logits(images_to_tensor(images)).items()}


def caption_labels(caption: str) -> dict[str, int]:
    """Attributes a caption asks for (main object = the first one named; background). Natural
    captions are read through the grammar's form first (scenes.parse_caption)."""
    words = parse_caption(caption).split()
    shape = next(w for w in words if w in SHAPES)
    colour = next(w for w in words if w in COLOURS)
    background = next(BACKGROUND_KEYWORDS[w] for w in words if w in BACKGROUND_KEYWORDS)
    position = next(w for w in words if w in POSITIONS)
    return {"shape": SHAPES.index(shape), "colour": list(COLOURS).index(colour),
            "background": BACKGROUNDS.index(background), "position": POSITIONS.index(position)}
