"""Quality and content-awareness numbers for the benchmark.

For the built-in model: prompt fidelity (the judge's attribute accuracy against the caption) and
FID/KID through torchmetrics with the judge's features in place of Inception.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

QUINTILES = 5


def detail_map(image: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Gradient energy of each token's pixel patch: uint8 [H, W, 3] -> [rows, cols]."""
    x = image.astype(np.float32).mean(-1)
    gy, gx = np.zeros_like(x), np.zeros_like(x)
    gy[1:] = np.diff(x, axis=0)
    gx[:, 1:] = np.diff(x, axis=1)
    energy = gy**2 + gx**2
    rows, cols = grid
    ph, pw = x.shape[0] // rows, x.shape[1] // cols
    return energy[: rows * ph, : cols * pw].reshape(rows, ph, cols, pw).mean((1, 3))


def by_detail_quintile(details: list[np.ndarray], values: list[np.ndarray],
                       edges: np.ndarray) -> list[float]:
    """Mean of `values` per detail quintile (Q1 smoothest .. Q5 most detailed)."""
    d, v = np.concatenate([x.ravel() for x in details]), np.concatenate([x.ravel() for x in values])
    which = np.searchsorted(edges, d, side="right")
    return [float(v[which == q].mean()) if (which == q).any() else float("nan")
            for q in range(QUINTILES)]


def quintile_edges(details: list[np.ndarray]) -> np.ndarray:
    d = np.concatenate([x.ravel() for x in details])
    return np.quantile(d, [0.2, 0.4, 0.6, 0.8])


def fidelity_by_attribute(judge, images: list, captions: list[str]) -> dict[str, float]:  # noqa: ANN001
    """Share of images whose main shape / colour / position / background the judge reads as the
    caption asks, per attribute."""
    from ..models.builtin.judge import caption_labels, predict

    pred = predict(judge, images)
    hits: dict[str, list[bool]] = {}
    for i, cap in enumerate(captions):
        for k, v in caption_labels(cap).items():
            if k in pred:
                hits.setdefault(k, []).append(int(pred[k][i]) == v)
    return {k: float(np.mean(v)) for k, v in hits.items()}


def fidelity_scores(judge, images: list, captions: list[str]) -> np.ndarray:  # noqa: ANN001
    """Per image: the share of its requested attributes (main shape, colour and position,
    background) the judge sees; attributes the judge has no head for are not counted."""
    from ..models.builtin.judge import caption_labels, predict

    pred = predict(judge, images)
    scores = []
    for i, cap in enumerate(captions):
        want = caption_labels(cap)
        scores.append(np.mean([int(pred[k][i]) == v for k, v in want.items() if k in pred]))
    return np.array(scores, float)


def prompt_fidelity(judge, images: list, captions: list[str]) -> float:  # noqa: ANN001
    """Mean of `fidelity_scores` (every caption asks the same number of attributes)."""
    return float(fidelity_scores(judge, images, captions).mean())


def feature_distances(judge, real: list, fake: list) -> dict[str, float]:  # noqa: ANN001
    """FID and KID (x1000) between two image sets, with the judge as feature network."""
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    from ..models.builtin.judge import images_to_tensor

    judge.eval()
    r, f = images_to_tensor(real), images_to_tensor(fake)
    fid = FrechetInceptionDistance(feature=judge, normalize=True, input_img_size=(3, 64, 64))
    subset = min(50, len(r), len(f))
    with warnings.catch_warnings():  # KID keeps features in memory: a few hundred here
        warnings.simplefilter("ignore", UserWarning)
        kid = KernelInceptionDistance(feature=judge, normalize=True, subset_size=subset,
                                      subsets=20)
    with torch.no_grad():
        for metric in (fid, kid):
            metric.update(r, real=True)
            metric.update(f, real=False)
        kid_mean, _ = kid.compute()
        return {"fid": float(fid.compute()), "kid_x1000": 1000 * float(kid_mean)}


# Pixels within this RGB distance of an object colour count as that colour, and blobs of fewer
# pixels than MIN_OBJECT_PIXELS are specks, not objects (a small object covers about 250 of the
# 64 x 64). Chosen on rendered held-out scenes (seeds 90,000,000 on): the count equals the
# number of objects of that colour for 99.0 % of 383 objects in 300 scenes (wider radii take
# in sky, sunset and gravel pixels).
COLOUR_RADIUS = 35.0
MIN_OBJECT_PIXELS = 60


def object_count(image, colour: tuple[int, int, int]) -> int:  # noqa: ANN001
    """How many separate objects of `colour` an image shows: connected regions of pixels near
    the colour (8-connected, after a 3x3 opening that removes grain), MIN_OBJECT_PIXELS or more.
    image: PIL image or uint8 array [H, W, 3]."""
    from scipy import ndimage

    x = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, np.float32)
    near = np.linalg.norm(x - np.array(colour, np.float32), axis=-1) < COLOUR_RADIUS
    near = ndimage.binary_opening(near, np.ones((3, 3), bool))
    labels, n = ndimage.label(near, np.ones((3, 3), bool))
    if n == 0:
        return 0
    return int((np.bincount(labels.ravel())[1:] >= MIN_OBJECT_PIXELS).sum())
