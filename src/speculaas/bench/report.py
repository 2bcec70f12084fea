"""Benchmark report: markdown table, summary JSON, Pareto plot, acceptance-map strips."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import torch

from ..decoding.costs import modelled_seconds
from ..io import atomic_path, save_image, write_text
from . import metrics
from .maps import acceptance_figure

# A speed-up over AR above this times the step compression is reported as suspicious: a
# speculative forward never costs less than AR's one-token step on the same machine.
CONTENTION_MARGIN = 1.15

# FID/KID from fewer images than this are noise (KID can even come out hugely negative).
MIN_FID_IMAGES = 16


def run_metadata(model) -> dict:  # noqa: ANN001
    """What produced these numbers: versions, code revision, device, threads."""
    import platform
    import subprocess

    import transformers

    from .. import __version__

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    device = model.device
    return {"speculaas": __version__, "git_commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "device": str(device), "gpu": torch.cuda.get_device_name(device)
            if device.type == "cuda" else None, "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "weights_id": getattr(model, "weights_id", None)}


def _decode(model, rows: list[dict]) -> list:  # noqa: ANN001
    images = []
    for start in range(0, len(rows), 64):
        chunk = rows[start : start + 64]
        tokens = torch.tensor([r["tokens"] for r in chunk], device=model.device)
        images += model.decode(model.layout.sequence(tokens))
    return images


def _pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both x and y (higher is better on both)."""
    return [i for i, (x, y) in enumerate(points)
            if not any(x2 >= x and y2 >= y and (x2, y2) != (x, y) for x2, y2 in points)]


def write_report(cfg, model, prompts: list, rows: list[dict]) -> dict:  # noqa: ANN001
    out: Path = cfg.out
    labels = [v.label for v in cfg.variants]
    by_variant = {lab: sorted([r for r in rows if r["variant"] == lab],
                              key=lambda r: (r["prompt_index"], r["seed"])) for lab in labels}
    n_tokens = model.layout.grid[0] * model.layout.grid[1]
    grid = model.layout.grid
    judge = getattr(model, "judge", None)
    images = {lab: _decode(model, rs) for lab, rs in by_variant.items() if rs}
    notes = []
    reference = None
    if judge is not None:
        from ..models.builtin.scenes import sample_scenes
        reference = [s.image for s in sample_scenes(500, seed=95_000_000)]
    else:
        notes.append(f"quality metrics skipped: model {cfg.model!r} has no judge network; "
                     "prompt fidelity and FID/KID need the built-in model (or, for real "
                     "checkpoints, local CLIP/Inception weights)")

    ar_label = next((lab for lab in labels if lab == "ar"), None)
    ar_latency = (statistics.median(r["latency_s"] for r in by_variant[ar_label])
                  if ar_label and by_variant[ar_label] else None)
    # Detail quintiles from the AR images (the reference picture of the content), same edges
    # for every method.
    detail = {lab: [metrics.detail_map(np.asarray(im), grid) for im in ims]
              for lab, ims in images.items()}
    edge_source = detail.get(ar_label) or next(iter(detail.values()), [])
    edges = metrics.quintile_edges(edge_source) if edge_source else None

    summary = {"config": {"model": cfg.model, "prompts": cfg.prompts, "n_prompts": len(prompts),
                          "seeds": cfg.seeds, "window": cfg.window,
                          "variants": labels}, "run": run_metadata(model),
               "variants": {}, "notes": notes}
    for lab in labels:
        rs = by_variant[lab]
        if not rs:
            continue
        fps = [r["forward_passes"] for r in rs]
        lat = [r["latency_s"] for r in rs]
        hist = np.sum([r["accept_hist"] for r in rs], axis=0)
        iters = hist.sum()
        s = {
            "items": len(rs),
            "forward_passes_mean": float(np.mean(fps)),
            "step_compression": float(np.mean([n_tokens / f for f in fps])),
            "accepted_drafts_per_forward": float((hist * np.arange(len(hist))).sum() / iters),
            "accept_hist": hist.tolist(),
            "latency_median_s": statistics.median(lat),
            "speedup_vs_ar": (ar_latency / statistics.median(lat)) if ar_latency else None,
            "rule_overhead_pct": 100 * sum(r["rule_seconds"] for r in rs) / sum(lat),
            "head_share_pct": 100 * sum(r.get("head_seconds", 0.0) for r in rs) / sum(lat),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in rs),
        }
        if ar_label and lab != ar_label:
            pairs = pair_speedups(by_variant[ar_label], rs)
            if pairs is not None:
                s["speedup_pairs_median"], s["speedup_pairs_iqr"] = pairs[0], list(pairs[1:])
                note = contention_note(lab, pairs[0], s["step_compression"])
                if note:
                    notes.append(note)
        curve = getattr(cfg, "cost_curve", None)
        if curve is not None and all("windows" in r for r in rs):
            # AR on the curve: one step per token; each image: its forwards at their windows.
            ar_step = curve.get(0, curve.get(1))
            modelled = [n_tokens * ar_step / modelled_seconds(curve, r["windows"]) for r in rs]
            s["modelled_speedup"] = statistics.median(modelled)
        if edges is not None:
            drafted = [np.array(r["drafted"], float).reshape(grid) for r in rs]
            steps = [np.array(r["commit_step"]).reshape(grid) for r in rs]
            runs = [np.bincount(st.ravel())[st] for st in steps]
            s["drafted_share_by_detail_quintile"] = metrics.by_detail_quintile(
                detail[lab], drafted, edges)
            s["run_length_by_detail_quintile"] = metrics.by_detail_quintile(
                detail[lab], runs, edges)
        if judge is not None:
            caps = [r["prompt"] for r in rs]
            scores = metrics.fidelity_scores(judge, images[lab], caps)
            s["prompt_fidelity"] = float(scores.mean())
            # Standard error over images: the noise any fidelity difference is judged against.
            s["prompt_fidelity_se"] = float(scores.std(ddof=1) / np.sqrt(len(scores))) \
                if len(scores) > 1 else None
            if len(rs) >= MIN_FID_IMAGES:
                s |= {f"{k}_vs_rendered": v for k, v in
                      metrics.feature_distances(judge, reference, images[lab]).items()}
                if ar_label and lab != ar_label and len(images.get(ar_label, [])) == len(rs):
                    s |= {f"{k}_vs_ar": v for k, v in
                          metrics.feature_distances(judge, images[ar_label], images[lab]).items()}
            elif f"fewer than {MIN_FID_IMAGES}" not in " ".join(notes):
                notes.append(f"FID/KID not reported: fewer than {MIN_FID_IMAGES} images per "
                             "variant, where their estimates mean nothing (use more prompts or "
                             "seeds)")
        summary["variants"][lab] = s

    write_text(out / "summary.json", json.dumps(summary, indent=2))
    table = render_table(summary)
    write_text(out / "table.md", table + "\n")
    _plot_pareto(summary, out / "pareto.png")
    _write_maps(cfg, grid, by_variant, images, out / "maps")
    summary["table"] = table
    return summary


def _fmt(x, spec: str = ".2f") -> str:  # noqa: ANN001
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    return format(x, spec)


def pair_speedups(ar_rows: list[dict], rows: list[dict]) -> tuple[float, float, float] | None:
    """Per (prompt, seed) pair run side by side: AR's latency over the variant's. -> (median,
    first quartile, third quartile), None with fewer than two pairs. The spread is the noise a
    speed-up is read against."""
    ar_by = {(r["prompt_index"], r["seed"]): r["latency_s"] for r in ar_rows}
    ratios = [ar_by[(r["prompt_index"], r["seed"])] / r["latency_s"] for r in rows
              if (r["prompt_index"], r["seed"]) in ar_by]
    if len(ratios) < 2:
        return None
    q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return med, q1, q3


def contention_note(label: str, speedup: float, compression: float) -> str | None:
    """A speed-up well above the step compression means AR's timings were slowed (each
    speculative forward costs at least AR's one-token step), not that speculation won."""
    if speedup <= CONTENTION_MARGIN * compression:
        return None
    return (f"warning: {label} is {speedup:.2f}x faster than AR with only {compression:.2f}x "
            "fewer forwards, which no forward can do: AR's timings were slowed (a busy "
            "machine?); rerun on a quiet one")


def _pairs(s: dict) -> str:
    if "speedup_pairs_median" not in s:
        return ""
    q1, q3 = s["speedup_pairs_iqr"]
    return f" ({s['speedup_pairs_median']:.2f}x [{q1:.2f}-{q3:.2f}])"


# What each column of the table means (printed under it).
COLUMNS = """Columns: fwd passes: target forwards per image (AR: one per token). step compr.: tokens
per forward. drafts/fwd: accepted drafts per forward. latency: median seconds per call.
speed-up: AR's median latency over the variant's (pairs: the median and interquartile range of
per-prompt ratios, prompt and seed matched). rule %: share of the decode spent inside the
acceptance rule (entropy, TV, ...), and inside a trained draft head's chains (head).
peak MB: peak memory. fidelity: the judge's accuracy on the caption's attributes (1 = every
attribute drawn). FID rend.: FID against the scenes rendered from the captions; FID / KIDx1e3
vs AR: against AR's images of the same prompts (0: the same distribution). drafted Q1..Q5:
share of tokens committed as accepted drafts, by the image's local detail quintile (smooth to
detailed)."""


def _head_share(s: dict) -> str:
    share = s.get("head_share_pct")
    return f" / head {share:.1f}" if share else ""


def render_table(summary: dict) -> str:
    head = ("| variant | images | fwd passes | step compr. | drafts/fwd | latency med (s) | "
            "speed-up (pairs: median [IQR]) | rule % | peak MB | fidelity | FID rend. | "
            "FID vs AR | KIDx1e3 vs AR | drafted Q1..Q5 (smooth..detailed) |")
    modelled = any("modelled_speedup" in s for s in summary["variants"].values())
    if modelled:  # --cost-curve: the speed-up on that curve (e.g. a GPU's)
        head += " modelled speed-up |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for lab, s in summary["variants"].items():
        q = s.get("drafted_share_by_detail_quintile")
        extra = f" {_fmt(s.get('modelled_speedup'))}x |" if modelled else ""
        lines.append(
            f"| {lab} | {s['items']} | {s['forward_passes_mean']:.1f} | "
            f"{s['step_compression']:.2f}x | {s['accepted_drafts_per_forward']:.2f} | "
            f"{s['latency_median_s']:.3f} | {_fmt(s['speedup_vs_ar'])}x{_pairs(s)} | "
            f"{s['rule_overhead_pct']:.1f}{_head_share(s)} | {s['peak_memory_mb']:.0f} | "
            f"{_fmt(s.get('prompt_fidelity'), '.3f')} | {_fmt(s.get('fid_vs_rendered'), '.1f')} | "
            f"{_fmt(s.get('fid_vs_ar'), '.1f')} | {_fmt(s.get('kid_x1000_vs_ar'), '.1f')} | "
            f"{' / '.join(f'{x:.2f}' for x in q) if q else '-'} |" + extra)
    lines.append(f"\n{COLUMNS}")
    for note in summary.get("notes", []):
        lines.append(f"\n{note}")
    return "\n".join(lines)


def _plot_pareto(summary: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    labs = list(summary["variants"])
    xs = [summary["variants"][lab]["step_compression"] for lab in labs]
    quality = "prompt_fidelity" if all("prompt_fidelity" in summary["variants"][lab]
                                       for lab in labs) else None
    ys = [summary["variants"][lab][quality] if quality else 0.0 for lab in labs]
    speedups = [summary["variants"][lab]["speedup_vs_ar"] or 0.0 for lab in labs]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, xv, xlabel in ((axes[0], xs, "step compression (tokens per target forward)"),
                           (axes[1], speedups, "wall-clock speed-up vs AR (same run)")):
        ax.scatter(xv, ys)
        for k, (x, y, lab) in enumerate(zip(xv, ys, labs, strict=True)):
            # alternate label offsets so neighbouring points' labels do not sit on each other
            ax.annotate(lab, (x, y), fontsize=6.5, xytext=(4, 6 if k % 2 else -10),
                        textcoords="offset points")
        front = sorted(_pareto(list(zip(xv, ys, strict=True))), key=lambda i: xv[i])
        if len(front) > 1:  # a front of one point is no line
            ax.plot([xv[i] for i in front], [ys[i] for i in front], "r--", lw=1,
                    label="Pareto front")
            ax.legend(fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("prompt fidelity (judge accuracy)" if quality else "(no quality metric)")
    axes[0].set_title("fewer forwards vs quality")
    axes[1].set_title("less waiting vs quality")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _write_maps(cfg, grid: tuple[int, int], by_variant: dict, images: dict,  # noqa: ANN001
                folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    labels = [lab for lab in by_variant if by_variant[lab]]
    for p in range(cfg.maps):
        ims, steps, ents, titles = [], [], [], []
        for lab in labels:
            idx = next((k for k, r in enumerate(by_variant[lab])
                        if r["prompt_index"] == p and r["seed"] == 0), None)
            if idx is None:
                continue
            r = by_variant[lab][idx]
            ims.append(images[lab][idx])
            steps.append(torch.tensor(r["commit_step"]).view(grid))
            ents.append(torch.tensor(r["entropy"]).view(grid))
            titles.append(f"{lab}: {r['forward_passes']} fwd")
        if ims:
            fig = acceptance_figure(ims, torch.stack(steps), torch.stack(ents), titles,
                                    caption=str(r["prompt"]))
            save_image(fig, folder / f"prompt{p}.png")
