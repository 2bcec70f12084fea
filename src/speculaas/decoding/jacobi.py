"""Speculative Jacobi decoding with a pluggable acceptance rule; every image advances on its own.

One iteration, for each unfinished image with n committed tokens:
  window  = [last committed token, d_0 .. d_{K-1}]      d_j is the draft for position n + j
  forward -> target_probs q_0 .. q_K                     q_j is the distribution of position n + j
  verify  d_j against q_j with the rule; a = index of the first rejection (K if none)
  commit  d_0 .. d_{a-1}, then one token at position n + a: resampled from the rule's residual
          if d_a was rejected, else (all K accepted) a bonus token from q_K
  recycle the drafter's coupling turns slots j > a into the next drafts, declared as q_j
          (independent samples y_j ~ q_j is the Jacobi update); the drafter's initialiser
          fills the rest of the window with fresh drafts (see drafting.py)
The KV cache needs no explicit rollback: each image writes its next window at its committed
length and attention masks keys beyond the query's position.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..acceptance.base import AcceptanceRule
from ..acceptance.functional import first_rejection
from ..config import JacobiConfig, SamplingConfig
from ..models.base import ImageModel, Session
from ..sampling import sample_with_uniform, target_probs
from .autoregressive import autoregressive_decode
from .drafting import COUPLINGS, FRESH_INITS, Coupling, FreshSlots, Tail
from .result import Commits, DecodeResult, draw
from .window import WindowPolicy, make_policy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def jacobi_decode(
    model: ImageModel,
    session: Session,
    rule: AcceptanceRule,
    sampling: SamplingConfig,
    jacobi: JacobiConfig,
    generators: list[torch.Generator],
    progress=None,  # noqa: ANN001
    profile: bool = False,
    policy: WindowPolicy | None = None,
) -> DecodeResult:
    batch, length = session.batch_size, model.layout.length
    policy = make_policy(jacobi.window) if policy is None else policy
    policy.begin(model, session, sampling.uses_cfg, lossless=rule.lossless)
    if policy.plain_ar():
        res = autoregressive_decode(model, session, sampling, generators, progress)
        hist = torch.zeros(batch, policy.max_window, dtype=torch.long, device=model.device)
        hist[:, 0] = res.iterations
        return dataclasses.replace(res, accept_hist=hist,
                                   mean_window=torch.ones(batch, device=model.device))
    vocab, window, dev = model.vocab_size, policy.max_window, model.device
    slots = torch.arange(window, device=dev)
    forced = torch.cat([model.layout.forced.to(dev), torch.full((window,), -1, device=dev)])
    dump = length + window  # column that absorbs writes of uncommitted slots
    record = Commits(batch, dump, dev)
    seq = record.tokens
    n = torch.zeros(batch, dtype=torch.long, device=dev)
    n_recycled = torch.zeros(batch, dtype=torch.long, device=dev)
    drafts = torch.zeros(batch, max(window - 1, 1), dtype=torch.long, device=dev)
    draft_probs = torch.zeros(batch, max(window - 1, 1), vocab, device=dev)
    forward_passes = torch.zeros(batch, dtype=torch.long, device=dev)
    hist = torch.zeros(batch, window, dtype=torch.long, device=dev)
    rule_seconds, it = 0.0, 0
    init = FRESH_INITS[jacobi.draft_init](vocab, length // model.layout.grid[0], batch, dev)
    has_forced = bool((model.layout.forced >= 0).any())  # raster layouts skip that work
    coupling = COUPLINGS[jacobi.coupling](vocab, generators, dev)

    while True:
        act = (n < length).nonzero().squeeze(1)
        if act.numel() == 0:
            break
        b, na = act.numel(), n[act]
        w_act = policy.choose(act)
        outputs = torch.minimum(length - na, w_act)  # distributions each image uses
        L = int(outputs.max())
        K = L - 1
        rnd = draw(generators, act, 3 * window + 1, dev)
        u_fresh = rnd[:, 2 * window + 1 :]

        # Drafts: recycled ones first, fresh ones after, forced tokens where required.
        pos = na[:, None] + slots[:L]  # [b, L] generated positions of the outputs
        f = forced[pos]
        fresh = slots[:K] >= n_recycled[act, None]
        d, dp = drafts[act, :K], draft_probs[act, :K]
        fd, fdp = init.fill(FreshSlots(act, pos[:, :K], fresh, na, na + n_recycled[act], d, dp,
                                       seq, u_fresh[:, :K]))
        d = torch.where(fresh, fd, d)
        dp = torch.where(fresh[..., None], fdp, dp)
        fk = f[:, :K]
        if has_forced:
            d = torch.where(fk >= 0, fk, d)
            dp = torch.where((fk >= 0)[..., None], _onehot(fk.clamp(min=0), vocab, dp.dtype), dp)

        anchor = seq[act, (na - 1).clamp(min=0)]
        cond, uncond = session.forward(torch.cat([anchor[:, None], d], 1), na, act)
        q = target_probs(cond, uncond, sampling, model.layout.structural)  # [b, L, V]
        if has_forced:
            q = torch.where((f >= 0)[..., None], _onehot(f.clamp(min=0), vocab, q.dtype), q)

        acc, _, extra, y, y_dist, seconds = verify_window(
            rule, coupling, act, d, dp, q, pos, outputs, rnd, window,
            forced=fk if has_forced else None, profile=profile)
        rule_seconds += seconds

        # Slot j carries: an accepted draft (j < a), the committed extra (j == a), or the
        # coupling's next draft with its declared distribution (j > a).
        j = slots[:L]
        d_pad = torch.cat([d, y[:, K:]], 1)
        out_tok = torch.where(
            j < acc[:, None], d_pad, torch.where(j == acc[:, None], extra[:, None], y)
        )
        if jacobi.advance == "batch_min":
            # Reference-code behaviour: everyone commits as many as the worst image; the others'
            # accepted drafts are recycled with their old draft distribution and tested again.
            limit = acc.min().expand(b)
            dp_pad = torch.cat([dp, q[:, K:]], 1)
            out_dist = torch.where((j < acc[:, None])[..., None], dp_pad, y_dist)
        else:
            limit, out_dist = acc, y_dist
        keep = j <= limit[:, None]
        init.committed(act, pos, keep, q)
        record.write(act, pos, keep, out_tok, it, j < acc[:, None], q)

        # Only the first K slots can be recycled (n_recycled <= K); a window policy's larger
        # buffers stay untouched.
        src = (limit[:, None] + 1 + slots[:K]).clamp(max=L - 1)
        drafts[act, :K] = out_tok.gather(1, src)
        draft_probs[act, :K] = out_dist.gather(1, src[..., None].expand(-1, -1, vocab))
        n_recycled[act] = (L - 1 - limit).clamp(min=0)
        n[act] = na + limit + 1
        forward_passes[act] += 1
        hist[act, limit] += 1
        policy.observe(act, w_act, outputs, acc)
        it += 1
        if progress is not None:
            progress.update(int((limit + 1).clamp(max=length - na).sum()))

    return record.result(length, forward_passes=forward_passes, accept_hist=hist,
                         iterations=it, rule_seconds=rule_seconds,
                         mean_window=policy.mean_window())


def verify_window(rule: AcceptanceRule, coupling: Coupling, act: torch.Tensor, d: torch.Tensor,
                  dp: torch.Tensor, q: torch.Tensor, pos: torch.Tensor, outputs: torch.Tensor,
                  rnd: torch.Tensor, window: int, forced: torch.Tensor | None = None,
                  profile: bool = False, ragged: bool = False) -> tuple[torch.Tensor, ...]:
    """Verify every window at once and draw what the loop may commit or recycle.

    d [b, K], dp [b, K, V]: drafts and their declared laws; q [b, L, V] targets (L = K + 1);
    outputs [b]: distributions each window really has (<= L); rnd [b, >= 2 * window + 1]:
    verification uniforms, then coupling uniforms, then the extra token's. forced [b, K]: the
    token forced at each draft slot (-1 where free), accepted whatever the rule says. ragged:
    windows of several lengths share the batch, so the coupling is told where each one's
    drafts end (outputs - 1).
    Returns acc [b] (first rejection, capped at the last real draft), rejected [b], extra [b]
    (drawn from the rule's residual at a rejection, else a bonus from q at acc), the coupling's
    next drafts y [b, L] with their laws y_dist [b, L, V], and the seconds spent in the rule.
    """
    b, L = q.shape[:2]
    K, dev = L - 1, q.device
    rows, slots = torch.arange(b, device=dev), torch.arange(max(K, 1), device=dev)
    u_accept, u_sample, u_extra = rnd[:, :window], rnd[:, window : 2 * window], rnd[:, 2 * window]
    if profile:
        _sync(dev)
    t0 = time.perf_counter()
    if K > 0:
        a_prob = rule.compute_acceptance(d, dp, q[:, :K])
        ok = u_accept[:, :K] < a_prob
        if forced is not None:
            ok |= forced >= 0
        ok &= slots[:K] < (outputs - 1)[:, None]
        acc = first_rejection(ok)
        at = acc.clamp(max=K - 1)
        residual = rule.compute_residual(
            dp[rows, at][:, None], q[rows, at][:, None], d[rows, at][:, None]
        )[:, 0]
    else:
        acc = torch.zeros(b, dtype=torch.long, device=dev)
    if profile:
        _sync(dev)
    seconds = time.perf_counter() - t0
    rejected = acc < outputs - 1
    extra_probs = q[rows, acc]
    if K > 0:
        extra_probs = torch.where(rejected[:, None], residual, extra_probs)
    extra = sample_with_uniform(extra_probs, u_extra)
    y, y_dist = coupling.redraft(Tail(act, d, dp, q, pos, u_accept[:, :L], u_sample[:, :L],
                                      n_drafts=(outputs - 1).clamp(min=0) if ragged else None))
    return acc, rejected, extra, y, y_dist, seconds


def _onehot(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, vocab).to(dtype)
