"""The decoding loop: one step() for every decoding order, over one DecodeState.

One iteration, for every segment the frontier plans (a window of an image: the committed token
before `start`, then drafts d_0 .. d_{K-1} for positions start .. start + K - 1):
  drafts   those waiting at the segment's positions (stored by position), fresh ones after them
           from the drafter's initialiser, forced tokens where the layout requires them
  forward  one target forward over every segment -> q_0 .. q_K, the targets of start .. start + K
  verify   the rule tests d_j against q_j; the extra token at the first rejection comes from the
           rule's residual (or is a bonus from q_K); the coupling redrafts the tail (verify.py)
  commit   accepted drafts and the extra token; the tail's tokens become drafts with their laws
The KV cache needs no explicit rollback: each image writes its next window at its committed
positions and attention masks keys beyond the query's position.

Host synchronisation: one per iteration, the `.tolist()` of the frontier's summary (committed
counts, the window the policy chose) together with the finiteness flag of the previous
iteration's targets; everything else stays on the device.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..acceptance import get as get_rule
from ..acceptance.base import AcceptanceRule
from ..config import JacobiConfig, SamplingConfig
from ..models.base import ImageModel, Session
from ..sampling import explain_nonfinite, gumbel_argmax, target_probs
from .autoregressive import AutoregressiveLoop, autoregressive_decode
from .costs import CurveSource, cost_curve
from .drafting import COUPLINGS, FRESH_INITS, FreshSlots, HeadDrafter, blend_for
from .frontier import Frontier, Raster
from .frontier_rows import Rows
from .result import DecodeResult
from .state import DecodeState, Uniforms
from .tree import Tree, tree_width
from .verify import Commit, Verdict, Window, settle, verify
from .window import AutoWindow, WindowPolicy, make_policy


class Loop:
    def __init__(self, model: ImageModel, session: Session, rule: AcceptanceRule,
                 sampling: SamplingConfig, jacobi: JacobiConfig, frontier: Frontier,
                 generators: list[torch.Generator], progress=None, profile: bool = False,  # noqa: ANN001
                 drafter=None) -> None:  # noqa: ANN001
        self.model, self.session, self.rule, self.sampling = model, session, rule, sampling
        self.frontier, self.progress, self.profile = frontier, progress, profile
        vocab, dev, length = model.vocab_size, model.device, model.layout.length
        self.init = FRESH_INITS[jacobi.draft_init](vocab, length // model.layout.grid[0])
        self.coupling = COUPLINGS[jacobi.coupling](vocab)
        self.gumbel = gumbel_verification(jacobi, rule)
        self.needs_noise = self.gumbel or self.coupling.needs_noise
        self.head = None
        if drafter is not None:  # a trained head drafts the head of every window
            self.head = HeadDrafter(drafter, model.draft_io(), sampling,
                                    model.layout.structural, jacobi.draft_depth,
                                    jacobi.head_blend)
        session.record_features = self.head is not None
        self.state = self.new_state(generators)
        self.finite = torch.ones((), dtype=torch.bool, device=dev)
        self.logits: tuple | None = None
        self.committed = 0

    def new_state(self, generators: list[torch.Generator],
                  noise_table: torch.Tensor | None = None) -> DecodeState:
        """A fresh DecodeState; noise_table: reuse one already computed (the cost curve's timing
        starts many states: rebuilding the table each time would also evict the weights from
        the CPU caches before every timed step)."""
        m = self.model
        state = DecodeState.new(generators, m.layout.length, m.vocab_size,
                                self.frontier.ring(m), self.frontier.max_window, m.device)
        state.noise_table = noise_table
        if self.needs_noise and noise_table is None:
            state.tabulate_noise()
        for part in self._parts():
            part.begin(state.memory, generators, m.device)
        return state

    def _parts(self) -> list:
        """The drafting parts that keep per-image memory."""
        return [self.init, self.coupling] + ([self.head] if self.head is not None else [])

    def restart(self, rows: list[int], generators: list[torch.Generator]) -> None:
        """Continuous batching: rows `rows` start new images with these random streams
        (DecodeState.restart), with the drafters' memory of a fresh image."""
        self.state.restart(rows, generators)
        fresh: dict[str, torch.Tensor] = {}
        for part in self._parts():
            part.begin(fresh, generators, self.model.device)
        idx = torch.tensor(rows, device=self.model.device)
        for key, value in fresh.items():
            self.state.memory[key][idx] = value

    def check(self, host_flag: int) -> None:
        if not host_flag:
            explain_nonfinite(*self.logits, self.sampling)

    def step(self) -> bool:
        """One iteration; False (and nothing done) when every image is finished."""
        s, f = self.state, self.frontier
        host = torch.cat([s.count, f.summary(s), self.finite.long().view(1)]).tolist()
        self.check(host[-1])
        counts = host[: s.batch]
        if self.progress is not None:
            self.progress.update(sum(counts) - self.committed)
            self.committed = sum(counts)
        plan = f.plan(s, counts, host[s.batch : -1])
        if plan is None:
            return False
        L = plan.pos.shape[1]
        K, dev = L - 1, plan.pos.device
        if K == 0 and self.gumbel and self.head is None and type(f) is Raster:
            self._ar_step(plan)
            return True
        if self.gumbel:  # no uniform is read
            u = Uniforms.split(torch.zeros(1, Uniforms.count(plan.window), device=dev),
                               plan.window).take(torch.zeros_like(plan.img))
        else:
            u = s.uniforms(plan.images, plan.segments, plan.window).take(plan.urow)
        noise = s.noise(plan.img, plan.pos) if self.needs_noise else None
        dpos = plan.pos[:, :K]
        d, dp, n_rec = s.drafts_at(plan.img, dpos)
        fresh = torch.arange(K, device=dev) >= n_rec[:, None]
        fd, fdp = self.init.fill(FreshSlots(plan.img, dpos, fresh, plan.start, plan.start + n_rec,
                                            d, dp, s.tokens, u.fresh[:, :K], s.memory))
        if self.gumbel:  # a fresh slot's guess: the Gumbel argmax of its draft law
            fd = gumbel_argmax(fdp, noise[:, :K])
        d = torch.where(fresh, fd, d)
        dp = torch.where(fresh[..., None], fdp, dp)
        forced = None if plan.forced is None else plan.forced[:, :K]
        if self.head is not None and K > 0:
            if self.profile:
                _sync(dev)
                t0 = time.perf_counter()
            hd, hdp, use = self.head.draft(s.memory, plan.img, plan.start, s.tokens, K,
                                           noise[:, :K] if self.gumbel else None,
                                           u.fresh[:, :K], forced, dp)
            D = hd.shape[1]
            d[:, :D] = torch.where(use[:, None], hd, d[:, :D])
            dp[:, :D] = torch.where(use[:, None, None], hdp, dp[:, :D])
            if self.profile:
                _sync(dev)
                s.head_seconds += time.perf_counter() - t0
        if forced is not None:
            d = torch.where(forced >= 0, forced, d)
            dp = torch.where((forced >= 0)[..., None], _onehot(forced, dp), dp)

        f.propose(d, dp, noise)
        cond, uncond = f.forward(self.session, plan, s, d)
        q = target_probs(cond, uncond, self.sampling, self.model.layout.structural, check=False)
        self.finite, self.logits = torch.isfinite(q.sum(-1)).all(), (cond, uncond)
        if plan.forced is not None:
            q = torch.where((plan.forced >= 0)[..., None], _onehot(plan.forced, q), q)

        w = Window(plan.img, plan.pos, d, dp, q, plan.outputs, forced, plan.ragged, noise)
        v = verify(self.rule, self.coupling, w, u, s.memory, self.profile, self.gumbel)
        c, q = f.extend(w, v, settle(w, v, plan.takes_extra, f.limit(plan, v)), u)
        self.init.committed(s.memory, plan.img, plan.pos, c.keep, q)
        if self.head is not None:
            self.head.observe(s.memory, plan.img, c.keep, self.session.features, c.decider,
                              plan.pos, d, c.tail)
        s.commit(plan.img, plan.pos, c.keep, c.tokens, c.drafted, q)
        s.keep_drafts(plan.img, plan.pos, c.tail, c.tokens, c.laws)
        f.observe(s, plan, v, c)
        s.iteration += 1
        s.rule_seconds += v.rule_seconds
        return True

    def _ar_step(self, plan) -> None:  # noqa: ANN001
        """A one-token iteration under Gumbel verification (every segment is its anchor alone,
        where no window pays): the plain AR step, the Gumbel argmax of each image's target
        under its noise, with no drafts to make, verify or keep; the bookkeeping is step()'s
        for a window of one slot, so a decode may switch between the two at any iteration."""
        s, f = self.state, self.frontier
        noise = s.noise(plan.img, plan.pos)
        no_drafts = s.tokens.new_zeros(len(plan.img), 0)
        cond, uncond = f.forward(self.session, plan, s, no_drafts)
        q = target_probs(cond, uncond, self.sampling, self.model.layout.structural, check=False)
        self.finite, self.logits = torch.isfinite(q.sum(-1)).all(), (cond, uncond)
        if plan.forced is not None:
            q = torch.where((plan.forced >= 0)[..., None], _onehot(plan.forced, q), q)
        tokens = gumbel_argmax(q, noise)  # [G, 1]: AR's sample at each position
        none = torch.zeros_like(plan.img)
        keep = torch.ones_like(tokens, dtype=torch.bool)
        v = Verdict(none, none.bool(), tokens[:, 0], tokens, q)
        c = Commit(none, tokens, q, keep, ~keep, ~keep)
        self.init.committed(s.memory, plan.img, plan.pos, keep, q)
        s.commit(plan.img, plan.pos, keep, tokens, ~keep, q)
        f.observe(s, plan, v, c)
        s.iteration += 1

    def run(self) -> DecodeResult:
        while self.step():
            pass
        self.check(bool(self.finite))
        return self.state.result()


def gumbel_verification(jacobi: JacobiConfig, rule: AcceptanceRule) -> bool:
    """Whether a decode verifies by Gumbel argmax (asked for, and the rule is exact)."""
    return jacobi.verify == "gumbel" and rule.exact


def _onehot(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens.clamp(min=0), like.shape[-1]).to(like.dtype)


@torch.inference_mode()
def decode(model: ImageModel, session: Session, rule: AcceptanceRule, sampling: SamplingConfig,
           jacobi: JacobiConfig, generators: list[torch.Generator], progress=None,  # noqa: ANN001
           profile: bool = False, policy: WindowPolicy | None = None,
           drafter=None) -> DecodeResult:  # noqa: ANN001
    """Speculative Jacobi decoding of a batch; jacobi.row_context picks the frontier (raster
    order under a window policy, or several rows at once). A policy that would never speculate
    decodes plain AR. Nothing is timed up front: window="auto" starts from a stored or
    reference cost curve and, where the rule verifies sample-exactly, refines it from the
    decode's own iterations and stores it when the decode ends (costs.py). drafter: a trained
    draft head (drafter/head.py) drafting the head of every raster window (a tree's chain, whose
    other candidates come from the head's law); its measured prior,
    if it has one, is the auto window's."""
    gumbel = gumbel_verification(jacobi, rule)
    if drafter is not None and jacobi.row_context is not None:
        raise ValueError("a trained drafter drafts raster chains (with or without a tree): it "
                         "cannot be combined with row_context yet")
    tag = curve_tag(session, sampling, rule, jacobi)
    if drafter is not None:
        tag += (f"/head={drafter.head_id}:{jacobi.draft_depth or drafter.cfg.depth}"
                f":{blend_for(drafter, jacobi.head_blend):g}")
    costs = CurveSource(model, session.batch_size, sampling.uses_cfg, tag, learn=gumbel)
    if jacobi.row_context is not None:
        frontier: Frontier = Rows(model, int(jacobi.window), int(jacobi.row_context))
    else:
        policy = make_policy(jacobi.window) if policy is None else policy
        prior = (drafter.target.get("prior", {}).get("lossless" if rule.exact else "relaxed")
                 if drafter is not None else None)
        if prior and isinstance(policy, AutoWindow) and policy.prior is None:
            policy.prior = {int(w): float(e) for w, e in prior.items()}
        if jacobi.tree is not None and isinstance(policy, AutoWindow):
            width = tree_width(policy, jacobi.tree, session.batch_size, rule.exact, costs)
            policy = policy if width is None else WindowPolicy(width)
        if jacobi.tree is not None and not isinstance(policy, AutoWindow):
            frontier = Tree(model, policy, jacobi.tree, rule, sampling, gumbel)
        else:
            frontier = Raster(model, policy, batch_min=jacobi.advance == "batch_min")
    loop = Loop(model, session, rule, sampling, jacobi, frontier, generators, progress, profile,
                drafter)

    frontier.begin(model, session, loop.state, sampling.uses_cfg, rule.exact, costs)
    if isinstance(frontier, Raster) and frontier.policy.plain_ar():
        res = autoregressive_decode(model, session, sampling, generators, progress,
                                    keys=loop.state.keys)
        hist = torch.zeros(len(generators), frontier.max_window, dtype=torch.long,
                           device=model.device)
        hist[:, 0] = res.iterations
        res = dataclasses.replace(res, accept_hist=hist)
    else:
        res = loop.run()
    if isinstance(frontier, Raster) and isinstance(frontier.policy, AutoWindow):
        costs.save((0, *frontier.policy.candidates))
    return res


def curve_tag(session: Session, sampling: SamplingConfig, rule: AcceptanceRule,
              jacobi: JacobiConfig) -> str:
    """What else the cost of an iteration depends on, beside the model, batch and guidance:
    the rule, the drafter, the verification, top-k / top-p work over the vocabulary, the
    prompt's length (attention over it; bucketed by powers of two)."""
    context = session.context_length()
    verify = "gumbel" if gumbel_verification(jacobi, rule) else "ratio"
    return (f"{rule.name}/{jacobi.draft_init}/{jacobi.coupling}/{verify}/"
            f"top_k={sampling.top_k is not None}/top_p={sampling.top_p is not None}/"
            f"context<={1 << max(context - 1, 0).bit_length()}")


def measure_cost_curve(model: ImageModel, session: Session, sampling: SamplingConfig,
                       windows: tuple[int, ...], rule: AcceptanceRule | None = None,
                       jacobi: JacobiConfig | None = None, sweeps: int = 4,
                       warm: int = 2, timed: int = 2, drafter=None,  # noqa: ANN001
                       tag: str | None = None) -> dict[int, float]:
    """Median wall time of one iteration of this loop at each window size for this batch, in
    seconds; window 0 is one step of plain AR decoding. What is timed is step() itself, with
    the decode's rule and drafter, from a state half-way through the images (no drafts waiting:
    every draft slot is fresh). Each sweep runs every window `warm` + `timed` times and times the
    last `timed` calls (a decode repeats its window, so caches are warm for it: after a 64-slot
    step, one untimed AR step was not enough and the next still ran ~40 % slow on a 2-core
    CPU, which pushed batches of 8 into speculation that loses); sweeps interleave windows so that
    drift from a cold start or a busy neighbour hits all of them alike: on a 2-core CPU the same
    step varies by 20 % from one second to the next, and AR and speculation are compared by
    ratio. Runs on the decode's own session: what a window writes past a committed prefix never
    influences later results (the Session contract), so the measurement leaves no trace.
    Cached (costs.cost_curve) under `tag` (default: curve_tag's); what decodes of the setting
    start from afterwards. drafter: a draft head drafting every timed window (its chain
    included in the time)."""
    rule = get_rule("sjd") if rule is None else rule
    jacobi = JacobiConfig(window=max(windows)) if jacobi is None else jacobi
    length, batch, dev = model.layout.length, session.batch_size, model.device

    def time_all(todo: tuple[int, ...]) -> dict[int, float]:
        start = max(0, min(length // 2, length - max(todo)))
        gens = [torch.Generator(device=dev).manual_seed(i) for i in range(batch)]
        ar = AutoregressiveLoop(model, session, sampling, gens)
        loops = {w: Loop(model, session, rule, sampling, jacobi, Raster(model, WindowPolicy(w)),
                         gens, drafter=drafter) for w in todo if w}
        times: dict[int, list[float]] = {w: [] for w in todo}
        table = None
        for _ in range(sweeps):
            for w in todo:
                for call in range(warm + timed):
                    if w:
                        loops[w].state = loops[w].new_state(gens, table)
                        loops[w].state.committed_prefix(start)
                        if drafter is not None:  # as if a feature had been kept: the head runs
                            loops[w].state.memory[HeadDrafter.has_key].fill_(True)
                        table = loops[w].state.noise_table
                    _sync(dev)
                    t0 = time.perf_counter()
                    loops[w].step() if w else ar.step(start)
                    _sync(dev)
                    if call >= warm:
                        times[w].append(time.perf_counter() - t0)
        return times

    tag = curve_tag(session, sampling, rule, jacobi) if tag is None else tag
    with torch.inference_mode():
        return cost_curve(model, batch, sampling.uses_cfg, tag, windows, time_all)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
