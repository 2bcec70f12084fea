"""The picture of where a two-dimensional window commits: one caption decoded by csd in raster
order and with row_context 2 / 4, each beside its maps (tokens per forward, the iteration that
committed each cell, target entropy).

    python benchmarks/rows_picture.py [--out docs/rows_map.png]
"""

from __future__ import annotations

import argparse

import torch

import speculaas as sp
from speculaas.bench.maps import acceptance_figure
from speculaas.io import save_image

CAPTION = "a big red circle on the left over grass"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/rows_map.png")
    p.add_argument("--caption", default=CAPTION)
    args = p.parse_args()
    model = sp.load_model("builtin")
    images, steps, ents, titles = [], [], [], []
    for c in (None, 4, 2):
        out = sp.generate(model, [args.caption], method="csd", delta=0.65, seed=0, row_context=c,
                          window=16)
        images += out.images
        steps.append(out.commit_step[0])
        ents.append(out.entropy[0])
        name = "raster" if c is None else f"row_context={c}"
        titles.append(f"csd(0.65) {name}: {int(out.forward_passes[0])} forwards")
    fig = acceptance_figure(images, torch.stack(steps), torch.stack(ents), titles, args.caption)
    save_image(fig, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
