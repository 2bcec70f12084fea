"""Candidate trees at the window head (the `tree=(K, D[, N])` option of a raster decode).

Why: after a rejection, the first slots of the next window were drafted on a context that has
just changed, and most iterations stop there (on the built-in model, sjd at window 64: 68 % of
iterations accept no draft). A tree guesses that slot's committed token K ways and runs the
positions after each guess in the same forward.

Candidates at depth n (the n-th position after the committed token), shared by every parent at
that depth as in SJD-PAC: rank 0 is the draft the chain already holds there; ranks 1 .. K-2
the next most likely tokens of its draft law (under Gumbel verification the largest law /
noise, i.e. the tokens most likely to be the position's AR sample); rank K-1 is the parent's
own token (the left neighbour), which alone catches 17 % of the committed tokens that the law's
top three miss. Layout: not the full K-ary tree (K + K^2 + .. + K^D nodes, mostly deep paths
that are never walked) but the N off-chain paths with the largest product of per-rank hit
rates (likely_paths; N defaults to the full tree or half the window, whichever is smaller),
then the chain fills the rest of the width. Measured on 8 held-out captions at 64 slots, sjd:
chain 3.12x, SJD-PAC's full 3x3 tree 3.28x, with the left neighbour 3.52x, pruned (4, 6, 32)
3.64x.

One packed forward feeds [anchor, chain drafts, off-chain nodes]; each node sees the committed
prefix, its ancestors and itself (Session.forward_packed; the off-chain nodes keep their keys in
scratch columns). The chain is verified exactly as without a tree (verify.py). Where it stops
at slot a with the committed extra token e, the walk goes on: if e is a candidate child of the
node that decided slot a, that child has already been run on the right context, so its output
decides slot a + 1: the chain's draft there is tested with the rule on it (or compared with the
Gumbel argmax), the rule's residual drawn on a rejection, and the committed token looked up
among the child's children again, until no child holds it. Every token committed this way is
decided by the same test, residual and noise the chain would have used at that slot on that
context, so each rule keeps its law (lossless rules stay lossless; sample-exact ones give AR's
tokens; tests/test_tree.py); the tree only saves forwards when the committed token was guessed.
The committed branch's keys are then copied from scratch to their positions
(Session.keep_scratch).

Uniforms: a walk step at slot j uses the accept and redraw uniforms of slot j, which the chain's
verification left unused (its first rejection came earlier), and which the coupling reads only
for the slots it keeps as drafts: those after everything committed.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..acceptance.base import AcceptanceRule
from ..config import SamplingConfig, tree_nodes
from ..models.base import SCRATCH_SLOTS, ImageModel, Session
from ..sampling import gumbel_argmax, sample_with_uniform, target_probs
from .costs import CurveSource
from .frontier import Plan, Raster
from .state import DecodeState, Uniforms
from .verify import Commit, Verdict, Window
from .window import PRIOR_TOKENS, AutoWindow, WindowPolicy, prior_tokens


@dataclass(frozen=True)
class TreeShape:
    """A tree of candidate ranks (K per position, depth up to D; the full K-ary tree or its
    likeliest paths), laid out after a chain of `main` slots (anchor included): slot s < main is
    the chain's (the tree's all-zero path for s <= D), slot main + i the i-th off-chain node,
    breadth first.

    depth [S], rank [S], parent [S]: each slot's depth (its input is position start - 1 + depth),
    its candidate rank and its parent's slot (-1: the anchor has none); child [S, K]: the slot
    of each child (-1: none); mask [S, S]: slot s attends to slot t (its ancestors and itself).
    """

    k: int
    d: int
    main: int
    depth: torch.Tensor
    rank: torch.Tensor
    parent: torch.Tensor
    child: torch.Tensor
    mask: torch.Tensor

    @property
    def off(self) -> int:
        return len(self.depth) - self.main

    @classmethod
    def build(cls, k: int, d: int, width: int, nodes: int) -> TreeShape:
        """The layout of a tree with K candidates per position, up to depth D and `nodes`
        off-chain nodes (the paths most likely to be walked: likely_paths) within `width` slots
        per image (anchor included)."""
        main = width - nodes
        if main < d + 1:
            raise ValueError(f"tree {k}x{d} with {nodes} off-chain nodes needs {nodes + d + 1} "
                             f"slots per image; the window gives {width} (raise window or "
                             "shrink the tree)")
        paths = likely_paths(k, d, nodes)
        slot = {p: main + i for i, p in enumerate(paths)}
        slot[()] = 0
        for n in range(1, d + 1):
            slot[(0,) * n] = n
        n_slots = main + len(paths)
        depth = torch.zeros(n_slots, dtype=torch.long)
        rank = torch.zeros(n_slots, dtype=torch.long)
        parent = torch.arange(n_slots, dtype=torch.long) - 1
        child = torch.full((n_slots, k), -1, dtype=torch.long)
        mask = torch.zeros(n_slots, n_slots, dtype=torch.bool)
        for s in range(main):  # the chain: causal
            depth[s] = s
            mask[s, : s + 1] = True
            if s + 1 < main:
                child[s, 0] = s + 1
        for p, s in slot.items():
            if len(p) < d:
                for r in range(k):
                    child[s, r] = slot.get(p + (r,), -1)
            if s >= main:
                depth[s], rank[s], parent[s] = len(p), p[-1], slot[p[:-1]]
                for n in range(len(p) + 1):
                    mask[s, slot[p[:n]]] = True
        return cls(k, d, main, depth, rank, parent, child, mask)


# How often a walk finds the committed token at each candidate rank (the chain's draft, the
# next likely tokens of its law, the left neighbour), measured on the built-in model's
# held-out captions (sjd, window 64); they only order the paths of a pruned tree.
RANK_WEIGHTS = (0.32, 0.16, 0.055, 0.037, 0.027, 0.02, 0.015, 0.012)
COPY_WEIGHT = 0.12


def likely_paths(k: int, d: int, nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` off-chain paths (rank tuples with a nonzero rank, at most d long) of the
    largest product of rank weights, breadth first (the last rank is the copy candidate)."""
    weight = [RANK_WEIGHTS[min(r, len(RANK_WEIGHTS) - 1)] for r in range(k - 1)] + [COPY_WEIGHT]
    heap = [(-weight[0] ** n * weight[r], (0,) * n + (r,))
            for n in range(d) for r in range(1, k)]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < nodes:
        w, p = heapq.heappop(heap)
        chosen.append(p)
        if len(p) < d:
            for r in range(k):
                heapq.heappush(heap, (w * weight[r], p + (r,)))
    if len(chosen) < nodes:
        raise ValueError(f"tree {k}x{d} has only {len(chosen)} off-chain nodes, not {nodes}")
    return sorted(chosen, key=lambda p: (len(p), p))


def tree_layout(tree: tuple[int, int, int | None], width: int) -> TreeShape:
    """The shape of tree (K, D, N) in a window of `width` slots per image: N off-chain nodes, or
    the full K-ary tree of depth D if it fits in half the window, else that half pruned."""
    k, d, n = tree
    if n is None:
        n = min(tree_nodes(k, d) - d, width // 2, SCRATCH_SLOTS)
    return TreeShape.build(k, d, width, n)


def check_tree(tree: tuple[int, int, int | None], model: ImageModel, window: object) -> None:
    """Whether `model` can decode with `tree` (parsed by config.parse_tree) within `window`."""
    k, _, _ = tree
    if not model.packed_forward:
        raise ValueError(f"model {model.name!r} cannot take a tree attention mask (no packed "
                         "forward); use tree=None")
    if bool((model.layout.forced >= 0).any()):
        raise ValueError(f"model {model.name!r} forces structural tokens (end of row), which "
                         "trees do not lay out; use tree=None")
    if k - 1 > model.vocab_size:
        raise ValueError(f"tree K={k} exceeds the vocabulary ({model.vocab_size}) plus the "
                         "left neighbour")
    if window != "auto":
        tree_layout(tree, int(window))


# Widths (slots per image per forward) at which window="auto" weighs a tree against the chain,
# and the prior committed tokens per iteration of a tree there: sjd (lossless) and csd at
# delta 0.65 (relaxed) with the default tree (4, 6) at half the width, on 16 built-in captions
# no benchmark uses x 2 seeds (`python benchmarks/window_prior.py --tree 4,6`,
# docs/trees/tree_prior.log).
TREE_WIDTHS = (32, 64, 128)
TREE_PRIOR_TOKENS = {
    "lossless": {32: 3.37, 64: 3.82, 128: 4.0},
    "relaxed": {32: 4.04, 64: 4.88, 128: 5.09},
}


def tree_width(policy: AutoWindow, tree: tuple[int, int, int | None], batch: int,
               lossless: bool, costs: CurveSource) -> int | None:
    """window="auto" with a tree: the width at which the tree promises the most committed
    tokens per second, if that beats the chain's best window under the same policy by the
    policy's margin; None: decode the chain (the policy then picks its windows as usual).
    Costs: the policy's given curve (where it lists the width), else the decode's starting
    curve at the width (a tree step prices as a chain step of the same width: the forward is
    the same size and the tree's mask and bookkeeping are small beside it)."""
    widths = []
    for w in TREE_WIDTHS:
        try:
            tree_layout(tree, w)
        except ValueError:
            continue
        widths.append(w)
    if not widths:
        return None
    kind = "lossless" if lossless else "relaxed"
    chain = policy.start_curve(costs)
    rates = [prior_tokens(PRIOR_TOKENS[kind], w) / chain[w] for w in policy.candidates
             if w in chain]
    if 0 in chain:
        rates.append(1 / chain[0])
    if policy.cost is not None:
        widths_cost = {w: policy.cost[w] for w in widths if w in policy.cost}
    else:
        widths_cost = costs.open().curve(widths)
    if not widths_cost:
        return None
    rate, width = max((prior_tokens(TREE_PRIOR_TOKENS[kind], w) / t, w)
                      for w, t in widths_cost.items())
    return width if rate > policy.margin * max(rates) else None


class Tree(Raster):
    """Raster order with a candidate tree at the head of every window: `window` is the width
    budget (slots per image per forward, the tree's included)."""

    def __init__(self, model: ImageModel, policy: WindowPolicy,
                 tree: tuple[int, int, int | None], rule: AcceptanceRule,
                 sampling: SamplingConfig, gumbel: bool) -> None:
        super().__init__(model, policy)
        if isinstance(policy, AutoWindow):
            raise ValueError("a tree needs a fixed window (its width budget), not window='auto'")
        self.shape = tree_layout(tree, policy.max_window)
        sh = self.shape
        self.rule, self.sampling, self.gumbel = rule, sampling, gumbel
        self.structural = model.layout.structural
        dev = model.device
        self.depth, self.rank = self.shape.depth.to(dev), self.shape.rank.to(dev)
        self.child, self.mask = self.shape.child.to(dev), self.shape.mask.to(dev)
        self.parent = self.shape.parent.to(dev)
        # The left-neighbour nodes (rank K-1) of each depth: they feed their parent's token.
        copies = (sh.rank == sh.k - 1) & (torch.arange(len(sh.rank)) >= sh.main)
        self.copy_levels = [(copies & (sh.depth == n)).nonzero()[:, 0].to(dev)
                            for n in range(1, sh.d + 1)]
        self.cand: torch.Tensor | None = None

    def plan(self, state: DecodeState, counts: list[int], host: list[int]) -> Plan | None:
        plan = super().plan(state, counts, [self.shape.main])
        if plan is not None:
            self.window = self.policy.max_window  # forwards are counted at the full width
        return plan

    def propose(self, drafts: torch.Tensor, laws: torch.Tensor,
                noise: torch.Tensor | None) -> None:
        """Candidates of depths 1 .. D: the chain's draft, the most likely other tokens of its
        law (law / noise under Gumbel verification), and last the parent's own token (the
        left neighbour: -1 here, filled per node). -> self.cand [G, D, K]."""
        sh = self.shape
        short = sh.d - drafts.shape[1]  # near the image end: depths past it are padding
        if short > 0:
            g, v = laws.shape[0], laws.shape[-1]
            drafts = torch.nn.functional.pad(drafts, (0, short))
            laws = torch.cat([laws, laws.new_full((g, short, v), 1.0 / v)], 1)
            if noise is not None and noise.shape[1] < sh.d:
                noise = torch.cat([noise, noise.new_ones(g, sh.d - noise.shape[1], v)], 1)
        main = drafts[:, : sh.d]
        score = laws[:, : sh.d] if noise is None else laws[:, : sh.d] / noise[:, : sh.d]
        score = score.scatter(-1, main[..., None], -1.0)
        self.cand = torch.cat([main[..., None], score.topk(sh.k - 2, -1).indices,
                               main.new_full((*main.shape, 1), -1)], -1)

    def forward(self, session: Session, plan: Plan, state: DecodeState,
                drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        sh, dev = self.shape, drafts.device
        g, n_out = len(plan.img), drafts.shape[1] + 1  # near the image end: fewer than main
        anchor = state.tokens[plan.img, (plan.start - 1).clamp(min=0)]
        chain = torch.nn.functional.pad(drafts, (0, sh.main - n_out))
        off = self.cand[:, self.depth[sh.main :] - 1, self.rank[sh.main :]]
        inputs = torch.cat([anchor[:, None], chain, off], 1)
        for level in self.copy_levels:  # its parent's token (parents come first: one pass)
            inputs[:, level] = inputs[:, self.parent[level]]
        self.anchor = anchor
        pos = plan.start[:, None] - 1 + self.depth
        valid = self.depth < plan.outputs[:, None]  # slots past the image end: padding
        valid[:, 0] = True
        window_mask = self.mask & valid[:, :, None] & valid[:, None, :]
        visible = (torch.arange(state.length, device=dev) < plan.start[:, None])[:, None]
        visible = visible.expand(g, len(self.depth), state.length)
        store = torch.zeros_like(valid)
        store[:, : sh.main] = True
        cond, uncond = session.forward_packed(inputs, pos.clamp(max=state.length - 1), plan.img,
                                              visible, window_mask, store & valid, sh.off)
        self.session = session
        # Every slot's logits (the walk indexes them by tree slot); the chain's go to verify().
        self.logits = (cond, uncond)
        return cond[:, :n_out], None if uncond is None else uncond[:, :n_out]

    def extend(self, w: Window, v: Verdict, c: Commit, u: Uniforms,
               ) -> tuple[Commit, torch.Tensor]:
        """The walk off the chain (module docstring): -> the commit and the targets that
        decided each slot."""
        sh = self.shape
        q = w.target_probs
        (g, L), dev = q.shape[:2], q.device
        cond, uncond = self.logits
        q_off = target_probs(cond[:, sh.main :], None if uncond is None else uncond[:, sh.main :],
                             self.sampling, self.structural, check=False)
        # [G, S, V]: the output of every slot (chain slots past the image end: never read)
        q_all = torch.cat([q, q[:, -1:].expand(-1, sh.main - L, -1), q_off], 1)
        rows = torch.arange(g, device=dev)
        j = v.accepted.clone()  # the slot being decided, per row
        tok = c.tokens[rows, j.clamp(max=L - 1)]  # what the chain committed there
        par = j.clone()  # the slot whose output decided it: the chain's slot j
        active = v.rejected & (c.limit == j) & (j < sh.d)
        limit = c.limit.clone()
        tokens, q_eff = c.tokens.clone(), q.clone()
        node_of = torch.full((g, sh.d + 1), -1, dtype=torch.long, device=dev)
        cand = torch.cat([self.cand, self.cand.new_full((g, 1, sh.k), -1)], 1)  # depth D+1
        # The token before slot j (a copy candidate's value): the anchor before slot 0.
        prev = torch.where(j > 0, c.tokens[rows, (j - 1).clamp(min=0)], self.anchor)
        for step in range(sh.d + 1):
            row = cand[rows, j.clamp(max=sh.d)]
            row[:, -1] = prev
            hits = row == tok[:, None]
            if not step:
                hits[:, 0] = False  # the chain's own draft there was rejected
            found = hits.any(1)
            node = self.child[par, hits.long().argmax(1)]
            active = active & found & (node >= 0) & (j + 1 < w.outputs)
            # The node holding the committed token at slot j: its output decides slot j + 1.
            node_of[rows, (j - v.accepted).clamp(0, sh.d)] = torch.where(active, node, -1)
            nxt = (j + 1).clamp(max=L - 1)
            qn = q_all[rows, node.clamp(min=0)]
            if self.gumbel:
                new = gumbel_argmax(qn, w.noise[rows, nxt])
            elif L > 1:  # the rule tests the chain's draft there on the right context
                has = nxt < L - 1
                at = nxt.clamp(max=L - 2)
                dj, pj = w.drafts[rows, at][:, None], w.draft_probs[rows, at][:, None]
                ok = u.accept[rows, nxt] < self.rule.supported_acceptance(dj, pj,
                                                                          qn[:, None])[:, 0]
                res = self.rule.compute_residual(pj, qn[:, None], dj)[:, 0]
                law = torch.where((has & ~ok)[:, None], res, qn)  # no draft there: a bonus
                new = torch.where(has & ok, dj[:, 0], sample_with_uniform(law, u.redraw[rows, nxt]))
            else:
                new = sample_with_uniform(qn, u.redraw[rows, nxt])
            tokens[rows, nxt] = torch.where(active, new, tokens[rows, nxt])
            q_eff[rows, nxt] = torch.where(active[:, None], qn, q_eff[rows, nxt])
            limit = torch.where(active, j + 1, limit)
            prev = tok
            j, par, tok = torch.where(active, j + 1, j), torch.where(active, node, par), new
        # Keys of the committed branch (all but the last committed token, fed next time).
        step_j = v.accepted[:, None] + torch.arange(sh.d + 1, device=dev)
        keep_kv = (node_of >= sh.main) & (step_j < limit[:, None])
        self.session.keep_scratch(w.img, torch.where(keep_kv, node_of - sh.main, -1),
                                  w.pos[rows[:, None], step_j.clamp(max=L - 1)])
        i = torch.arange(L, device=dev)
        keep = i <= limit[:, None]
        tail = (i > limit[:, None]) & (i < w.outputs[:, None])
        laws = c.laws
        # The slot whose output decided the last committed position: the walk's last node, or
        # the chain's slot `limit` where no walk went on (a trained head starts from its feature).
        decider = torch.where(limit != c.limit, par, limit.clamp(min=0))
        return Commit(limit, tokens, laws, keep, tail, i < limit[:, None], decider), q_eff
