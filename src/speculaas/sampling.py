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


# Gumbel-max sampling from noise fixed per (image, position, token). ----------------------------

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """An integer mixer (lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def image_keys(generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """One 32-bit noise key per image [B], the first draw from each image's own stream: every
    decode (AR or speculative, any batch) draws it first, so an image's noise depends only on
    its seed, and the uniforms drawn after it are independent of it."""
    return torch.stack([torch.randint(0, 2**32, (1,), generator=g, device=device)[0]
                        for g in generators])


_TOKEN_CODES: dict = {}


def _token_codes(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _TOKEN_CODES:
        _TOKEN_CODES[key] = (torch.arange(vocab, device=device) * 0x9E3779B1) & _MASK32
    return _TOKEN_CODES[key]


def exponential_noise(keys: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard exponential noise E fixed per (image key, generated position, token): keys [b],
    pos [b, L] -> [b, L, V] float32. -log(E) is standard Gumbel noise.

    A hash, not a random draw: a position gets the same noise at every iteration and in every
    decoding order, and no random tensor is kept or drawn. The 32-bit hash h becomes
    u = (h + 0.5) / 2**32 in float64, exactly, so 0 < u < 1, and E = -log(u) lies in
    [1.2e-10, 22.9], finite and positive also after rounding to float32 (computing u in float32
    rounds the largest 128 hashes to u = 1: E = 0, an infinite Gumbel value, for about 3e-8 of
    all (position, token) pairs).
    """
    base = _hash32((keys[:, None] + _hash32((pos + 0x632BE5AB) & _MASK32)) & _MASK32)
    x = base[..., None] ^ _token_codes(vocab, pos.device)
    # lowbias32 in place: the [b, L, V] tensor is the decode's largest temporary
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x.double().add_(0.5).mul_(1.0 / 2**32).log_().neg_().float()


def gumbel_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max sample argmax(log p + g) of probs [..., V] with g = -log(noise), computed
    as the equivalent exponential race argmax(p / E) (no logarithm per token). With E standard
    exponential it is distributed as p; zero-probability tokens are never returned."""
    return (probs / noise).argmax(-1)
