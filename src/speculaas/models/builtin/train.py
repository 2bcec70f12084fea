"""Train the built-in model from scratch: tokenizer, judge, then the AR transformer.

    speculaas train --out runs/builtin            # about 2.5 hours on 2 CPU cores
    speculaas train --out runs/builtin --device cuda
    python -m speculaas.models.builtin.train --out runs/builtin

Everything is seeded; the result is `OUT/builtin.safetensors` (tokenizer + transformer + judge)
and `OUT/training.json` (configs, steps, final losses, codebook usage, times, git revision).
The run checkpoints to `OUT/checkpoints/` every `--checkpoint-every` steps (weights, optimiser,
random-generator states) and, run again with the same `--out`, resumes from the last checkpoint
of the stage it was in: a killed run loses at most one checkpoint interval and ends with the same
weights as an uninterrupted one. Copy both result files into
`src/speculaas/models/builtin/weights/` to ship them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from ...io import atomic_path, check_writable, write_text
from ..transformer import Decoder, DecoderConfig
from . import vq as vqlib
from .judge import Judge, images_to_tensor, scene_labels
from .scenes import CAPTION_LEN, WORDS, sample_scenes, tokenize_caption

# What each TrainConfig field sets (`speculaas train --help` shows these with the defaults).
OPTION_HELP = {
    "seed": "seed of the scenes, initialisation and batches",
    "vq_steps": "training steps of the VQ tokenizer",
    "vq_batch": "images per tokenizer step",
    "vq_lr": "tokenizer learning rate",
    "judge_steps": "training steps of the caption judge (the fidelity metric)",
    "judge_batch": "images per judge step",
    "ar_scenes": "distinct captioned scenes the transformer trains on",
    "ar_steps": "training steps of the AR transformer",
    "ar_batch": "sequences per transformer step",
    "ar_lr": "transformer peak learning rate",
    "ar_warmup": "linear warm-up steps of the transformer's learning rate",
    "ar_refine_steps": "steps at the lower refine learning rate after the main run",
    "ar_refine_lr": "transformer learning rate of the refine steps",
    "caption_dropout": "share of captions replaced by the null prefix (what guidance needs)",
    "d_model": "transformer width",
    "n_layers": "transformer layers",
    "n_heads": "attention heads (must divide the width)",
    "checkpoint_every": "steps between checkpoints (a killed run resumes from the last)",
    "threads": "CPU threads torch may use",
    "device": "cpu, cuda or cuda:N",
}


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vq_steps: int = 1_200
    vq_batch: int = 16
    vq_lr: float = 1e-3
    judge_steps: int = 500
    judge_batch: int = 64
    ar_scenes: int = 40_960
    ar_steps: int = 3_000
    ar_batch: int = 32
    ar_lr: float = 1e-3
    ar_warmup: int = 100
    ar_refine_steps: int = 1_500
    ar_refine_lr: float = 3e-4
    caption_dropout: float = 0.1
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    checkpoint_every: int = 100
    threads: int = 2
    device: str = "cpu"

    def __post_init__(self) -> None:
        """Every option checked before any work: one ValueError naming the first bad one."""
        for name in ("vq_steps", "vq_batch", "judge_steps", "judge_batch", "ar_scenes",
                     "ar_steps", "ar_batch", "d_model", "n_layers", "n_heads",
                     "checkpoint_every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("ar_warmup", "ar_refine_steps", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for name in ("vq_lr", "ar_lr", "ar_refine_lr"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 < v <= 1):
                raise ValueError(f"--{_flag(name)} must be a learning rate in (0, 1], got {v}")
        if not 0 <= self.caption_dropout <= 1:
            raise ValueError(f"--caption-dropout is a probability in [0, 1], got "
                             f"{self.caption_dropout}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"--n-heads {self.n_heads} must divide --d-model {self.d_model} "
                             "into heads of an even width (rotary embeddings)")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"--device {self.device!r} is not a device (cpu, cuda, cuda:N)"
                             ) from None
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: no CUDA device is available here")


# Options that change nothing in the result, so a resumed run may change them.
NOT_SETTINGS = ("threads",)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _finite(loss: float, stage: str, step: int) -> float:
    if not math.isfinite(loss):
        raise ValueError(f"training stage {stage!r} diverged: the loss is {loss} at step "
                         f"{step + 1}; lower its learning rate")
    return loss


def decoder_config(cfg: TrainConfig, codebook_size: int) -> DecoderConfig:
    return DecoderConfig(
        vocab_in=len(WORDS) + codebook_size,
        vocab_out=codebook_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_len=CAPTION_LEN + 1 + 256 + 16,
    )


def _git_revision() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cosine_lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _save_state(path: Path, state: dict) -> None:
    """Write a checkpoint atomically: a kill mid-write leaves the previous one intact."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_state(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a torn file
        raise ValueError(f"the checkpoint {path} is damaged ({type(e).__name__}); delete it "
                         "to train that stage again") from None


def _cpu(module: torch.nn.Module) -> dict:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


class _Stage:
    """One resumable stage: its checkpoint file, its clock and its progress bar."""

    def __init__(self, out: Path, name: str, total: int) -> None:
        self.path, self.name, self.total = out / "checkpoints" / f"{name}.pt", name, total
        self.state = _load_state(self.path) or {"step": 0, "seconds": 0.0, "done": False}
        self.t0 = time.time() - self.state["seconds"]

    @property
    def step(self) -> int:
        return self.state["step"]

    def bar(self):  # noqa: ANN201
        return tqdm(range(self.step, self.total), desc=self.name, initial=self.step,
                    total=self.total, dynamic_ncols=True)

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load the last checkpoint's weights and optimiser state, if there is one."""
        if self.step:
            try:
                model.load_state_dict(self.state["model"])
                optimizer.load_state_dict(self.state["optimizer"])
            except (RuntimeError, KeyError, ValueError) as e:
                raise ValueError(f"the checkpoint {self.path} does not fit these settings "
                                 f"({str(e).splitlines()[0][:120]}); resume with the options of "
                                 "the run that wrote it, or use a new --out") from None

    def checkpoint(self, step: int, every: int, **parts) -> None:  # noqa: ANN003
        """After `step` (0-based): save every `every` steps and at the end."""
        done = step + 1 == self.total
        if done or (step + 1) % every == 0:
            self.state = {**self.state, **parts, "step": step + 1, "done": done,
                          "seconds": round(time.time() - self.t0, 1)}
            _save_state(self.path, self.state)


def _vq_restart_dead(vq, x: torch.Tensor, dead: torch.Tensor) -> None:  # noqa: ANN001
    """Move dead codes onto current encoder outputs so the whole codebook gets used."""
    with torch.no_grad():
        z = F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)
        zf = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        pick = torch.randint(len(zf), (len(dead),))
        vq.quantize.embedding.weight[dead] = zf[pick] + 0.01 * torch.randn_like(zf[pick])


def train_vq(cfg: TrainConfig, out: Path, log: dict) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    dev = torch.device(cfg.device)
    vq = vqlib.build_vq().train().to(dev)
    opt = torch.optim.Adam(vq.parameters(), lr=cfg.vq_lr)
    n_codes = vq.quantize.num_embeddings
    usage = torch.zeros(n_codes, device=dev)
    stage = _Stage(out, "tokenizer", cfg.vq_steps)
    stage.restore(vq, opt)
    if stage.step:
        usage = stage.state["usage"].to(dev)
        torch.set_rng_state(stage.state["rng"])
    if not stage.state["done"]:
        vq.train()
        bar = stage.bar()
        for step in bar:
            scenes = sample_scenes(cfg.vq_batch, seed=10_000_000 + step * cfg.vq_batch)
            x = vqlib.to_tensor(np.stack([s.image for s in scenes])).to(dev)
            for g in opt.param_groups:
                g["lr"] = _cosine_lr(step, cfg.vq_steps, cfg.vq_lr)
            rec, vql, idx = vqlib.train_loss(vq, x)
            (rec + vql).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            usage += torch.bincount(idx, minlength=n_codes).float()
            if step % 50 == 49 and step < cfg.vq_steps * 0.8:
                dead = (usage == 0).nonzero().squeeze(1)
                if len(dead):
                    _vq_restart_dead(vq, x, dead)
                usage.zero_()
            _finite(rec.item() + vql.item(), stage.name, step)
            bar.set_postfix(rec=f"{rec.item():.4f}", vq=f"{vql.item():.4f}")
            stage.checkpoint(step, cfg.checkpoint_every, model=_cpu(vq),
                             optimizer=opt.state_dict(), usage=usage.cpu(),
                             rng=torch.get_rng_state(), recon_mse=rec.item())
    log["vq_final_recon_mse"] = stage.state["recon_mse"]
    log["vq_seconds"] = stage.state["seconds"]
    return vq.eval()


def train_judge(cfg: TrainConfig, out: Path, log: dict) -> Judge:
    torch.manual_seed(cfg.seed + 1)
    dev = torch.device(cfg.device)
    judge = Judge().to(dev)
    stage = _Stage(out, "judge", cfg.judge_steps)
    opt = torch.optim.Adam(judge.parameters(), lr=2e-3)
    stage.restore(judge, opt)
    if not stage.state["done"]:
        judge.train()
        bar = stage.bar()
        for step in bar:
            scenes = sample_scenes(cfg.judge_batch, seed=20_000_000 + step * cfg.judge_batch)
            logits = judge.logits(images_to_tensor([s.image for s in scenes]).to(dev))
            labels = scene_labels(scenes)
            loss = sum(F.cross_entropy(logits[k], labels[k].to(dev)) for k in logits)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{_finite(loss.item(), stage.name, step):.3f}")
            stage.checkpoint(step, cfg.checkpoint_every, model=_cpu(judge),
                             optimizer=opt.state_dict(), loss=loss.item())
    log["judge_final_loss"] = stage.state["loss"]
    return judge.eval()


def tokenize_dataset(cfg: TrainConfig, vq, out: Path) -> torch.Tensor:  # noqa: ANN001
    """[ar_scenes, CAPTION_LEN + 1 + 256] ids: caption words, image start, image codes."""
    path = out / "checkpoints" / "data.pt"
    saved = _load_state(path)
    if saved is not None:
        return saved["ids"]
    rows = []
    for start in tqdm(range(0, cfg.ar_scenes, 256), desc="tokenize scenes", dynamic_ncols=True):
        scenes = sample_scenes(min(256, cfg.ar_scenes - start), seed=30_000_000 + start)
        codes = vqlib.encode(vq, np.stack([s.image for s in scenes])).cpu() + len(WORDS)
        caps = torch.tensor([tokenize_caption(s.caption) for s in scenes])
        rows.append(torch.cat([caps, codes], 1))
    ids = torch.cat(rows)
    _save_state(path, {"ids": ids})
    return ids


def codebook_stats(codes: torch.Tensor, n_codes: int) -> dict:
    """Usage (codes seen at least once) and perplexity exp(H) of the code frequencies."""
    freq = torch.bincount(codes.flatten(), minlength=n_codes).double()
    p = freq[freq > 0] / freq.sum()
    return {"codebook_size": n_codes, "codebook_used": int((freq > 0).sum()),
            "codebook_perplexity": round(float(torch.exp(-(p * p.log()).sum())), 1)}


def _fit_ar(model: Decoder, cfg: TrainConfig, data: torch.Tensor, stage: _Stage, *,
            lr: float, warmup: int, seed: int) -> None:
    """One cosine cycle of next-token training (with caption dropout), resumable."""
    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    stage.restore(model, opt)
    if stage.step:
        gen.set_state(stage.state["generator"])
    null = torch.tensor(tokenize_caption(None))
    n_text = len(WORDS)
    if stage.state["done"]:
        return
    model.train()
    bar = stage.bar()
    for step in bar:
        ids = data[torch.randint(len(data), (cfg.ar_batch,), generator=gen)].clone()
        drop = torch.rand(cfg.ar_batch, generator=gen) < cfg.caption_dropout
        ids[drop, : CAPTION_LEN + 1] = null  # caption dropout: learn the unconditional model
        ids = ids.to(dev)
        for g in opt.param_groups:
            g["lr"] = _cosine_lr(step, stage.total, lr, warmup)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        # Position CAPTION_LEN (the image-start token) predicts the first image code.
        target = ids[:, CAPTION_LEN + 1 :] - n_text
        loss = F.cross_entropy(
            logits[:, CAPTION_LEN:].float().reshape(-1, logits.shape[-1]), target.reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{_finite(loss.item(), stage.name, step):.3f}")
        stage.checkpoint(step, cfg.checkpoint_every, model=_cpu(model),
                         optimizer=opt.state_dict(), generator=gen.get_state(),
                         loss=loss.item())


def train_ar(cfg: TrainConfig, data: torch.Tensor, out: Path, log: dict) -> Decoder:
    """A cosine cycle of `ar_steps`, then a warm restart of `ar_refine_steps` at a lower rate.

    The second cycle continues from the first one's weights with a fresh optimiser; the loss
    is still falling at the end of the first, and a restart buys more than stretching it.
    """
    torch.manual_seed(cfg.seed + 2)
    model = Decoder(decoder_config(cfg, vqlib.VQ_KWARGS["num_embeddings"]))
    model = model.to(torch.device(cfg.device))
    first = _Stage(out, "transformer", cfg.ar_steps)
    refine = _Stage(out, "transformer-refine", cfg.ar_refine_steps) if cfg.ar_refine_steps else None
    if refine is None or not refine.step:
        _fit_ar(model, cfg, data, first, lr=cfg.ar_lr, warmup=cfg.ar_warmup, seed=cfg.seed + 3)
    log["ar_first_cycle_loss"] = first.state["loss"]
    log["ar_seconds"] = first.state["seconds"]
    last = first
    if refine is not None:
        _fit_ar(model, cfg, data, refine, lr=cfg.ar_refine_lr, warmup=50, seed=cfg.seed + 4)
        log["ar_refine_seconds"] = refine.state["seconds"]
        last = refine
    log["ar_final_loss"] = last.state["loss"]
    return model.eval()


def _check_out(out: Path) -> None:
    if str(out).strip() in ("", "."):
        raise ValueError("--out must name a folder for the run (not empty or '.')")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a folder")
    check_writable(out / "checkpoints" / "config.json")  # creates the folders it probes


def _check_resume(cfg: TrainConfig, config_path: Path) -> None:
    """A folder with checkpoints resumes only with the settings that wrote them."""
    if not config_path.is_file():
        if any(config_path.parent.glob("*.pt")):
            print(f"speculaas train: {config_path} is missing; the checkpoints beside it are "
                  "checked against these options as they load", flush=True)
        return
    try:
        stored = json.loads(config_path.read_text())
        if not isinstance(stored, dict):
            raise ValueError
    except ValueError:
        raise ValueError(f"{config_path} is damaged (not the JSON of a run's options); delete "
                         "it only if the checkpoints beside it came from these options, or use "
                         "a new --out") from None
    mine = asdict(cfg)
    diff = [f"{_flag(k)} {stored.get(k)!r} -> {mine.get(k)!r}"
            for k in sorted(set(stored) | set(mine))
            if k not in NOT_SETTINGS and stored.get(k) != mine.get(k)]
    if diff:
        raise ValueError(f"{config_path.parent.parent} holds checkpoints of a run with other "
                         f"settings ({'; '.join(diff)}); use a new --out or the same options")


def train(cfg: TrainConfig, out: Path) -> Path:
    """The whole recipe at cfg.threads threads (the caller's count is restored after it: a
    thread count changes float reductions, and with them every later decode's numerics)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, out)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig, out: Path) -> Path:
    _check_out(out)
    config_path = out / "checkpoints" / "config.json"
    _check_resume(cfg, config_path)
    write_text(config_path, json.dumps(asdict(cfg), indent=2))
    log: dict = {}
    revision = _git_revision()  # of the code that trains, not of whatever HEAD is at the end
    t0 = time.time()
    vq = train_vq(cfg, out, log)
    judge = train_judge(cfg, out, log)
    data = tokenize_dataset(cfg, vq, out)
    log |= codebook_stats(data[:, CAPTION_LEN + 1 :] - len(WORDS), vq.quantize.num_embeddings)
    model = train_ar(cfg, data, out, log)
    tensors = {f"vq.{k}": v for k, v in _cpu(vq).items()}
    tensors |= {f"ar.{k}": v for k, v in _cpu(model).items()}
    tensors |= {f"judge.{k}": v for k, v in _cpu(judge).items()}
    with atomic_path(out / "builtin.safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    record = {
        "train_config": asdict(cfg),
        "decoder_config": decoder_config(cfg, vqlib.VQ_KWARGS["num_embeddings"]).to_dict(),
        "vq_config": vqlib.VQ_KWARGS,
        "final": log,
        "seconds_this_invocation": round(time.time() - t0, 1),
        "git_revision": revision,
        "torch": torch.__version__,
        "device": cfg.device,
        # The loader checks it: a damaged weights file is named, never decoded into noise.
        "weights_sha256": hashlib.sha256((out / "builtin.safetensors").read_bytes()).hexdigest(),
    }
    write_text(out / "training.json", json.dumps(record, indent=2))
    return out / "builtin.safetensors"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="speculaas train", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the run (checkpoints, weights)")
    for name, field in TrainConfig.__dataclass_fields__.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=type(field.default), default=field.default,
            help=OPTION_HELP[name],
        )
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__})
    print(train(cfg, Path(args.out)))


if __name__ == "__main__":
    import sys

    try:
        main()
    except ValueError as e:
        print(f"speculaas train: error: {e}", file=sys.stderr)
        sys.exit(2)
