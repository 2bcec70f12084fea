"""Pictures of where decoding sped up: each image beside its acceptance and entropy maps."""

from __future__ import annotations

import io
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402


def run_lengths(commit_step: torch.Tensor) -> torch.Tensor:
    """Tokens committed in the same iteration as each token: [..., rows, cols] -> same shape."""
    flat = commit_step.flatten(-2)
    counts = torch.zeros(flat.shape[:-1] + (int(flat.max()) + 2,), dtype=torch.long)
    counts.scatter_add_(-1, flat.clamp(min=0), torch.ones_like(flat))
    return counts.gather(-1, flat.clamp(min=0)).view_as(commit_step)


def raster_order(commit_step: torch.Tensor) -> bool:
    """Whether every image of commit_step [N, H, W] committed its cells in raster order (no
    cell before one above or left of it): its commit-order map is then a plain top-to-bottom
    gradient that tells nothing."""
    flat = commit_step.flatten(1)
    return bool((flat[:, 1:] >= flat[:, :-1]).all())


def acceptance_figure(images: list[Image.Image], commit_step: torch.Tensor,
                      entropy: torch.Tensor, titles: list[str],
                      caption: str | None = None) -> Image.Image:
    """One row per image: the image, tokens committed per iteration at each grid cell (bright =
    committed in a long accepted run, i.e. where decoding sped up), the iteration that
    committed each cell (only where the order is not raster: a two-dimensional window's
    diagonal frontier; in raster order it is a plain top-to-bottom gradient), and the target
    entropy: how unsure the model was there, which is where csd's entropy term relaxes
    acceptance most. `caption`: the prompt, written above the figure (rows of different
    prompts carry theirs in `titles`)."""
    runs = run_lengths(commit_step)
    n = len(images)
    order = not raster_order(commit_step)
    cols = 4 if order else 3
    fig, axes = plt.subplots(n, cols, figsize=(2.6 * cols, 2.6 * n + (0.5 if caption else 0)),
                             squeeze=False)
    vmax = max(int(runs.max()), 2)
    for i in range(n):
        ax_img, ax_run, *rest = axes[i]
        ax_img.imshow(np.asarray(images[i].convert("RGB")), interpolation="nearest")
        ax_img.set_title(titles[i], fontsize=8)
        im = ax_run.imshow(runs[i].numpy(), cmap="viridis", vmin=1, vmax=vmax)
        ax_run.set_title("tokens per forward\n(bright: long accepted runs = speed)", fontsize=8)
        fig.colorbar(im, ax=ax_run, fraction=0.046)
        if order:
            ax_step = rest.pop(0)
            im = ax_step.imshow(commit_step[i].numpy(), cmap="cividis")
            ax_step.set_title("iteration that committed it", fontsize=8)
            fig.colorbar(im, ax=ax_step, fraction=0.046)
        ax_ent = rest[0]
        im = ax_ent.imshow(entropy[i].numpy(), cmap="magma")
        ax_ent.set_title("model's uncertainty (entropy, nats)\n(bright: csd relaxes most)",
                         fontsize=8)
        fig.colorbar(im, ax=ax_ent, fraction=0.046)
        for ax in axes[i]:
            ax.set_xticks([])
            ax.set_yticks([])
    if caption:
        fig.suptitle(textwrap.fill(caption, 90), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    buf.seek(0)
    return Image.open(buf).convert("RGB")
