"""Logits -> target probabilities (CFG, temperature, top-k, top-p), and sampling from them.

Every rule sees the probabilities this module returns; warping happens here, once.
"""

from __future__ import annotations

import torch

from .config import SamplingConfig


def combine_cfg(cond_logits: torch.Tensor, uncond_logits: torch.Tensor | None,
                scale: float | None) -> torch.Tensor:
    """Classifier-free guidance on logits: `uncond + scale * (cond - uncond)`."""
    if uncond_logits is None or scale is None or scale == 1.0:
        return cond_logits
    return uncond_logits + scale * (cond_logits - uncond_logits)


def warp_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p; masked entries become -inf. logits [..., vocab]."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, int(cfg.top_k), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def target_probs(cond_logits: torch.Tensor, uncond_logits: torch.Tensor | None,
                 cfg: SamplingConfig, suppress: tuple[int, ...] = (), check: bool = True,
                 ) -> torch.Tensor:
    """[..., vocab] logits of the conditional (and unconditional) rows -> probabilities.

    `suppress`: token ids that may not be sampled here (structural tokens at free positions).
    check: raise ValueError if a distribution is not finite (one host read); the decoding loop
    passes False and checks isfinite(probs.sum(-1)) with its own single read per iteration.
    """
    logits = combine_cfg(cond_logits.float(),
                         None if uncond_logits is None else uncond_logits.float(), cfg.cfg_scale)
    if suppress:
        logits[..., list(suppress)] = float("-inf")
    probs = warp_logits(logits, cfg).softmax(-1)
    # What the rules see must be a distribution. Bad logits, or guidance / temperature
    # overflowing float32 from finite logits, both end as NaN here, and a softmax row holding a
    # NaN sums to NaN: checking the row sums reads V times less than checking every probability.
    if check and not torch.isfinite(probs.sum(-1)).all():
        explain_nonfinite(cond_logits, uncond_logits, cfg)
    return probs


def explain_nonfinite(cond_logits: torch.Tensor, uncond_logits: torch.Tensor | None,
                      cfg: SamplingConfig) -> None:
    """Raise the ValueError that names why target probabilities came out NaN or infinite."""
    for raw in (cond_logits, uncond_logits):
        if raw is not None and not torch.isfinite(raw).all():
            kind = "NaN" if torch.isnan(raw).any() else "infinite"
            raise ValueError(f"the model produced {kind} logits; check the weights and the "
                             "inputs (dtype overflow in half precision is a common cause)")
    raise ValueError(f"the target probabilities are not finite after guidance and warping "
                     f"(cfg_scale={cfg.cfg_scale}, temperature={cfg.temperature}, "
                     f"top_k={cfg.top_k}, top_p={cfg.top_p}); lower cfg_scale or raise "
                     "temperature")


def sample_with_uniform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs [..., vocab] from uniform [...] in [0, 1).

    Uses the caller's uniforms, so a whole window is sampled from a few numbers per row rather
    than a [batch, window, vocab] random tensor. Zero-probability tokens are never returned.
    """
    cdf = probs.cumsum(-1)
    threshold = (uniform * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf.contiguous(), threshold.contiguous(), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)
