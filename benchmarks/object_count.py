"""How often the built-in model draws exactly the number of objects its caption names.

    python benchmarks/object_count.py [--captions 32] [--seeds 4] [--out docs/object_count.png]
        [--skip 0] [--caption TEXT] [--method ar] [--cfg-scale 2,3] [--temperature 0.8,1]
        [--top-k 0] [--top-p 1]

For held-out one-object captions (built-in scenes no benchmark uses), decodes each caption at
each seed (AR by default; sjd draws the same pictures); `bench.metrics.object_count` counts the
separate blobs of the captioned colour, and of every object colour (all objects drawn). Prints
the share of images with exactly one, none, and two or more, beside the same counts on the
rendered scenes themselves (what the counter gets wrong on ground truth) and the judge's prompt
fidelity, and saves a grid of the first images with their counts. Last lines: the JSON of
those shares, one line per sampling setting. `--caption` counts one caption of the user's at
seeds 0 .. seeds-1 instead (e.g. the README's, with `--method csd`). The sampling options (the
model's defaults when left out; `--cfg-scale` and `--temperature` take comma lists and run
every pair, with a table at the end) and `--skip` (start after that many held-out captions, so a
setting chosen on one caption set can be checked on another) measure sampling settings.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from PIL import Image, ImageDraw

import speculaas as sp
from speculaas.bench.metrics import fidelity_scores, object_count
from speculaas.bench.prompts import BUILTIN_SET_SEED
from speculaas.models.builtin.scenes import COLOURS, parse_caption, render_scene


def held_out(captions: int, skip: int) -> list:
    """One-object scenes no benchmark uses, after the first `skip`."""
    scenes, seed = [], BUILTIN_SET_SEED + 2000
    while len(scenes) < skip + captions:
        sc = render_scene(seed)
        seed += 1
        if len(sc.objects) == 1:
            scenes.append(sc)
    return scenes[skip:]


def count(image, colour: str) -> tuple[int, int]:  # noqa: ANN001
    """(objects of `colour`, objects of any colour) in the image, capped at 2."""
    return (min(object_count(image, COLOURS[colour]), 2),
            min(sum(object_count(image, c) for c in COLOURS.values()), 2))


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        msg = f"{text!r} is not a comma-separated list of numbers"
        raise argparse.ArgumentTypeError(msg) from None


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--captions", type=int, default=32, help="held-out captions")
    p.add_argument("--seeds", type=int, default=4, help="seeds per caption")
    p.add_argument("--out", default=None, help="grid PNG of the first images with counts")
    p.add_argument("--skip", type=int, default=0, help="held-out captions to pass over first")
    p.add_argument("--caption", default=None, help="one one-object caption instead")
    p.add_argument("--method", default="ar", choices=sp.METHODS)
    p.add_argument("--cfg-scale", type=_floats, default=[None], help="e.g. 2 or 2,3,4")
    p.add_argument("--temperature", type=_floats, default=[None], help="e.g. 1 or 0.8,1")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    args = p.parse_args(argv)
    if args.caption is not None:
        try:
            caption = parse_caption(args.caption)
        except ValueError as e:
            p.error(str(e))
        if " and " in caption:
            p.error(f"--caption {args.caption!r} names two objects; give one")
        # one image per call, at seed 0, 1, ...: what `speculaas generate --seed S` draws (a
        # relaxed rule's picture depends on the window, which auto picks per batch size)
        colours = [caption.split()[2]]
        batches = [([caption], [s]) for s in range(args.seeds)]
        truth = None
    else:
        scenes = held_out(args.captions, args.skip)
        captions = [sc.caption for sc in scenes]
        colours = [sc.objects[0].colour for sc in scenes]
        batches = [(captions, [1000 * s + i for i in range(len(scenes))])
                   for s in range(args.seeds)]
        truth = [count(sc.image, sc.objects[0].colour) for sc in scenes]
    model = sp.load_model("builtin")
    reports = []
    for cfg_scale in args.cfg_scale:
        for temperature in args.temperature:
            sampling = {k: v for k, v in (("cfg_scale", cfg_scale), ("temperature", temperature),
                                          ("top_k", args.top_k), ("top_p", args.top_p))
                        if v is not None}
            # the grid shows the first setting's images
            reports.append(measure(model, args, batches, colours, sampling, truth,
                                   None if reports else args.out))
    if len(reports) > 1:
        print("\n| CFG | temperature | one of its colour | one of any colour | two or more "
              "(any colour) | prompt fidelity |\n|---|---|---|---|---|---|")
        for r in reports:
            print(f"| {r['sampling'].get('cfg_scale', 'default')} | "
                  f"{r['sampling'].get('temperature', 'default')} | {r['exactly_one']:.1%} | "
                  f"{r['all_colours_exactly_one']:.1%} | {r['all_colours_two_or_more']:.1%} | "
                  f"{r['prompt_fidelity']:.3f} |")
    for r in reports:
        print(json.dumps(r))
    return reports


def measure(model, args: argparse.Namespace, batches: list, colours: list, sampling: dict,  # noqa: ANN001
            truth: list | None, grid_path: str | None) -> dict:
    """Decode every batch under `sampling`, count, print one line; the shares."""
    drawn, tiles, fidelity = [], [], []
    for batch, seeds in batches:
        out = sp.generate(model, batch, method=args.method, seed=seeds, **sampling)
        fidelity += fidelity_scores(model.judge, out.images, batch).tolist()
        drawn += [count(img, colour) for img, colour in zip(out.images, colours, strict=True)]
        tiles += out.images
    total = len(drawn)
    own, anyc = Counter(n for n, _ in drawn), Counter(n for _, n in drawn)
    report = {"images": total, "method": args.method, "sampling": sampling,
              "caption": args.caption,
              "exactly_one": own[1] / total, "none": own[0] / total,
              "two_or_more": own[2] / total,
              "all_colours_exactly_one": anyc[1] / total,
              "all_colours_two_or_more": anyc[2] / total,
              "prompt_fidelity": sum(fidelity) / total}
    what = (f"{args.caption!r} at seeds 0-{args.seeds - 1}" if args.caption is not None else
            f"{len(batches[0][0])} held-out one-object captions x {args.seeds} seeds")
    print(f"{total} {args.method} images of {what}: exactly one object of the captioned colour "
          f"{own[1]} ({report['exactly_one']:.1%}), none {report['none']:.1%}, two or more "
          f"{report['two_or_more']:.1%}; objects of any colour: exactly one {anyc[1]} "
          f"({report['all_colours_exactly_one']:.1%}), two or more "
          f"{report['all_colours_two_or_more']:.1%}; prompt fidelity "
          f"{report['prompt_fidelity']:.3f}")
    if truth is not None:
        report["rendered_exactly_one"] = sum(n == 1 for n, _ in truth) / len(truth)
        report["rendered_all_colours_exactly_one"] = sum(n == 1 for _, n in truth) / len(truth)
        print(f"the counter on the rendered scenes: exactly one of the colour "
              f"{report['rendered_exactly_one']:.1%}, of any colour "
              f"{report['rendered_all_colours_exactly_one']:.1%}")
    if grid_path:
        size = 128
        tiles = list(zip(tiles, (n for _, n in drawn), strict=True))[:32]
        grid = Image.new("RGB", (8 * size, ((len(tiles) + 7) // 8) * (size + 14)), "white")
        draw = ImageDraw.Draw(grid)
        for k, (img, n) in enumerate(tiles):
            x, y = (k % 8) * size, (k // 8) * (size + 14)
            grid.paste(img.resize((size, size), Image.NEAREST), (x, y + 14))
            draw.text((x + 4, y + 1), f"{n} object{'s' if n != 1 else ''} (any colour)",
                      fill="black")
        grid.save(grid_path)
    return report




if __name__ == "__main__":
    main()
