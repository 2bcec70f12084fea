"""Verification of a batch of windows: pure, batched, the same for every decoding order.

A window (a *segment*) holds drafts d_0 .. d_{K-1} for positions start .. start + K - 1 and the
target distributions q_0 .. q_K of positions start .. start + K (q_j from feeding the committed
token before `start` and d_0 .. d_{j-1}). A segment may have fewer real outputs than the
batch's widest (`outputs`): its drafts end at outputs - 1 and its extra token is at most there.

Two ways to test the drafts:
  ratio   draft j is accepted with the rule's probability (the uniforms of the image's stream);
          at the first rejection the extra token is drawn from the rule's residual there, and
          if every draft passed, a bonus token from q_K. Every rule; exact in distribution for
          lossless ones.
  gumbel  (exact rules only) with the image's noise g at each position, a_j = argmax(log q_j +
          g_j) is the token plain AR decoding samples there given the same prefix. Draft j is
          accepted when d_j = a_j; the extra token is a at the first mismatch (or the bonus
          a_K). Every committed token is then the AR sample of its position: identical to AR
          for the same seed, whatever the drafts. The next drafts are a_j themselves (the Gumbel
          argmax of the stale target), declared as q_j (no rule reads a law here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..acceptance.base import AcceptanceRule
from ..acceptance.functional import first_rejection
from ..sampling import gumbel_argmax, sample_with_uniform
from .drafting import Coupling, Tail
from .state import Uniforms


@dataclass
class Window:
    """G windows to verify; L = K + 1 output slots, V vocabulary.

    img [G]: image of each window. pos [G, L]: generated position of each output slot.
    drafts [G, K], draft_probs [G, K, V]: the drafts and the laws they were drawn from.
    target_probs [G, L, V]. outputs [G]: output slots each window really has (1 .. L).
    forced [G, K] or None: the token forced at each draft slot (-1 where free); a forced draft
    is accepted whatever the rule says. ragged: windows of several lengths share the batch, so
    the coupling is told that each one's drafts end at outputs - 1 (else every draft slot holds
    a draft: the tail of a raster window near the image end). noise [G, L, V] or None:
    the images' exponential noise at pos (DecodeState.noise), for Gumbel verification or a coupling
    that needs it.
    """

    img: torch.Tensor
    pos: torch.Tensor
    drafts: torch.Tensor
    draft_probs: torch.Tensor
    target_probs: torch.Tensor
    outputs: torch.Tensor
    forced: torch.Tensor | None = None
    ragged: bool = False
    noise: torch.Tensor | None = None


@dataclass
class Verdict:
    """accepted [G]: drafts accepted before the first rejection (at most outputs - 1).
    rejected [G]: whether a real draft was rejected (else every draft passed).
    extra [G]: the token drawn at slot `accepted` (from the residual after a rejection, else
    the bonus from the target). next_drafts [G, L], next_laws [G, L, V]: the coupling's drafts
    for every slot and their declared laws (the loop keeps those after what it commits).
    rule_seconds: time inside the rule (with `profile`, after the device has finished)."""

    accepted: torch.Tensor
    rejected: torch.Tensor
    extra: torch.Tensor
    next_drafts: torch.Tensor
    next_laws: torch.Tensor
    rule_seconds: float = 0.0


def verify(rule: AcceptanceRule, coupling: Coupling, w: Window, u: Uniforms,
           memory: dict[str, torch.Tensor] | None = None, profile: bool = False,
           gumbel: bool = False) -> Verdict:
    """Verify every window at once and draw what may be committed or kept as the next drafts.
    u: the windows' uniforms (accept and redraw at least L wide; unread under `gumbel`).
    memory: the decode's per-image memory, for couplings that keep some (DecodeState.memory).
    gumbel: Gumbel verification (w.noise given; only for an exact rule)."""
    q = w.target_probs
    (g, L), dev = q.shape[:2], q.device
    K = L - 1
    rows = torch.arange(g, device=dev)
    n_drafts = (w.outputs - 1).clamp(min=0)
    real = torch.arange(K, device=dev) < n_drafts[:, None]
    if profile and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    if gumbel:
        best = gumbel_argmax(q, w.noise)  # [G, L]: the AR sample of every slot
        ok = w.drafts == best[:, :K]
    else:
        ok = u.accept[:, :K] < rule.supported_acceptance(w.drafts, w.draft_probs, q[:, :K])
    if w.forced is not None:
        ok |= w.forced >= 0
    accepted = first_rejection(ok & real)
    rejected = accepted < n_drafts
    if gumbel:
        extra = best[rows, accepted]
    else:
        extra_probs = q[rows, accepted]
        if K > 0:
            at = accepted.clamp(max=K - 1)
            residual = rule.compute_residual(w.draft_probs[rows, at][:, None],
                                             q[rows, at][:, None], w.drafts[rows, at][:, None])
            extra_probs = torch.where(rejected[:, None], residual[:, 0], extra_probs)
    if profile and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    if gumbel:
        return Verdict(accepted, rejected, extra, best, q, seconds)
    extra = sample_with_uniform(extra_probs, u.extra)
    tokens, laws = coupling.redraft(Tail(w.img, w.drafts, w.draft_probs, q, w.pos,
                                         u.accept[:, :L], u.redraw[:, :L],
                                         n_drafts if w.ragged else None,
                                         memory if memory is not None else {}, w.noise))
    return Verdict(accepted, rejected, extra, tokens, laws, seconds)


@dataclass
class Commit:
    """What a window commits and keeps, given how its order treats a rejection.

    limit [G]: last committed slot (-1: nothing). tokens [G, L]: per slot the accepted draft,
    the extra token, or the coupling's next draft. laws [G, L, V]: the declared law of each
    slot's token where it stays a draft. keep [G, L]: committed slots. tail [G, L]: slots kept
    as the next drafts. drafted [G, L]: slots holding an accepted draft. decider [G] or None:
    the forward's slot whose output decided the last committed position (None: the last kept
    slot; a candidate tree's walk ends on an off-chain node).
    """

    limit: torch.Tensor
    tokens: torch.Tensor
    laws: torch.Tensor
    keep: torch.Tensor
    tail: torch.Tensor
    drafted: torch.Tensor
    decider: torch.Tensor | None = None


def settle(w: Window, v: Verdict, takes_extra: torch.Tensor,
           limit: torch.Tensor | None = None) -> Commit:
    """Slot j carries an accepted draft (j < accepted), the extra token (j == accepted, where
    `takes_extra` [G]: a rejected window of a lower row defers it), or the coupling's next draft.
    The window commits through `limit` [G] (default: accepted, or accepted - 1 where a rejected
    extra is deferred); a window with no outputs commits nothing."""
    L = w.target_probs.shape[1]
    j = torch.arange(L, device=w.pos.device)
    acc = v.accepted[:, None]
    takes = takes_extra | ~v.rejected
    if limit is None:
        limit = torch.where(takes, v.accepted, v.accepted - 1)
    limit = torch.where(w.outputs > 0, limit, -1)
    drafts = torch.cat([w.drafts, v.next_drafts[:, L - 1 :]], 1)
    laws = torch.cat([w.draft_probs, w.target_probs[:, L - 1 :]], 1)
    tokens = torch.where(j < acc, drafts,
                         torch.where((j == acc) & takes[:, None], v.extra[:, None],
                                     v.next_drafts))
    # An accepted draft that is not committed (lock-step batches) keeps its old law.
    laws = torch.where((j < acc)[..., None], laws, v.next_laws)
    keep = j <= limit[:, None]
    tail = (j > limit[:, None]) & (j < w.outputs[:, None])
    return Commit(limit, tokens, laws, keep, tail, j < acc)
