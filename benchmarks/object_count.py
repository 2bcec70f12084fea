"""How often the built-in model draws exactly the number of objects its caption names.

    python benchmarks/object_count.py [--captions 32] [--seeds 4] [--out docs/object_count.png]

For held-out one-object captions (built-in scenes no benchmark uses), AR decodes each caption
at each seed (sjd draws the same pictures); `bench.metrics.object_count` counts the separate
blobs of the captioned colour, and of every object colour (all objects drawn). Prints the share
of images with exactly one, none, and two or more, beside the same counts on the rendered
scenes themselves (what the counter gets wrong on ground truth), and saves a grid of the first
images with their counts. Last line: the JSON of those shares.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from PIL import Image, ImageDraw

import speculaas as sp
from speculaas.bench.metrics import object_count
from speculaas.bench.prompts import BUILTIN_SET_SEED
from speculaas.models.builtin.scenes import COLOURS, render_scene


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--captions", type=int, default=32)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--out", default=None, help="grid PNG of the first images with counts")
    args = p.parse_args(argv)
    scenes, seed = [], BUILTIN_SET_SEED + 2000
    while len(scenes) < args.captions:  # one-object captions only
        sc = render_scene(seed)
        seed += 1
        if len(sc.objects) == 1:
            scenes.append(sc)
    model = sp.load_model("builtin")
    truth = Counter(min(object_count(sc.image, COLOURS[sc.objects[0].colour]), 2)
                    for sc in scenes)
    truth_all = Counter(min(sum(object_count(sc.image, c) for c in COLOURS.values()), 2)
                        for sc in scenes)
    drawn, drawn_all, tiles = Counter(), Counter(), []
    for s in range(args.seeds):
        out = sp.generate(model, [sc.caption for sc in scenes], method="ar",
                          seed=[1000 * s + i for i in range(len(scenes))])
        for sc, img in zip(scenes, out.images, strict=True):
            n = object_count(img, COLOURS[sc.objects[0].colour])
            n_all = sum(object_count(img, c) for c in COLOURS.values())
            drawn[min(n, 2)] += 1
            drawn_all[min(n_all, 2)] += 1
            if len(tiles) < 32:
                tiles.append((img, n_all))
    total = sum(drawn.values())
    report = {"images": total,
              "exactly_one": drawn[1] / total, "none": drawn[0] / total,
              "two_or_more": drawn[2] / total,
              "rendered_exactly_one": truth[1] / len(scenes),
              "all_colours_exactly_one": drawn_all[1] / total,
              "all_colours_two_or_more": drawn_all[2] / total,
              "rendered_all_colours_exactly_one": truth_all[1] / len(scenes)}
    print(f"{total} AR images of {len(scenes)} one-object captions x {args.seeds} seeds: "
          f"exactly one object of the captioned colour {report['exactly_one']:.1%}, none "
          f"{report['none']:.1%}, two or more {report['two_or_more']:.1%} (the counter on the "
          f"rendered scenes: exactly one {report['rendered_exactly_one']:.1%}); objects of any "
          f"colour: exactly one {report['all_colours_exactly_one']:.1%}, two or more "
          f"{report['all_colours_two_or_more']:.1%} (rendered: exactly one "
          f"{report['rendered_all_colours_exactly_one']:.1%})")
    if args.out:
        size = 128
        grid = Image.new("RGB", (8 * size, ((len(tiles) + 7) // 8) * (size + 14)), "white")
        draw = ImageDraw.Draw(grid)
        for k, (img, n) in enumerate(tiles):
            x, y = (k % 8) * size, (k // 8) * (size + 14)
            grid.paste(img.resize((size, size), Image.NEAREST), (x, y + 14))
            draw.text((x + 4, y + 1), f"{n} object{'s' if n != 1 else ''} (any colour)",
                      fill="black")
        grid.save(args.out)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
