"""verify() and settle() on their own: hand-built distributions and uniforms, exact expected
outputs (the style of vLLM's rejection-sampler tests)."""

import math

import pytest
import torch

import speculaas as sp
from speculaas.acceptance import functional as F
from speculaas.api import build_rule
from speculaas.decoding.drafting import Independent, Maximal
from speculaas.decoding.state import Uniforms
from speculaas.decoding.verify import Window, settle, verify

P = torch.tensor  # float32 probabilities written out by hand


def window(drafts, draft_probs, target_probs, outputs=None, forced=None, ragged=False):  # noqa: ANN001, ANN201
    d, dp, q = torch.tensor(drafts), P(draft_probs), P(target_probs)
    g, L = q.shape[:2]
    out = torch.full((g,), L) if outputs is None else torch.tensor(outputs)
    pos = torch.arange(L).expand(g, -1)
    return Window(torch.arange(g), pos, d, dp, q, out,
                  None if forced is None else torch.tensor(forced), ragged)


def uniforms(accept, extra, redraw=None, fresh=None):  # noqa: ANN001, ANN201
    a = P(accept)
    return Uniforms(a, P(redraw) if redraw is not None else torch.full_like(a, 0.5), P(extra),
                    P(fresh) if fresh is not None else torch.zeros_like(a))


UNIFORM3 = [1 / 3, 1 / 3, 1 / 3]
# Draft laws and targets of a 2-draft window over a 3-token vocabulary.
DP = [[[0.6, 0.2, 0.2], UNIFORM3]]
Q = [[[0.2, 0.5, 0.3], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]]]


def test_sjd_accepts_below_the_ratio_and_resamples_the_residual_at_the_first_rejection():
    sjd = sp.acceptance.get("sjd")
    w = window([[1, 1]], DP, Q)
    # Slot 0: draft 1, ratio 0.5 / 0.2 > 1: accepted whatever u. Slot 1: draft 1, ratio 0.9.
    v = verify(sjd, Independent(3), w, uniforms([[0.99, 0.95, 0.0]], [0.0]))
    assert v.accepted.tolist() == [1] and v.rejected.tolist() == [True]
    # Residual at slot 1: max(0, q - p) = [0, 0, 1/6]: token 2 whatever the uniform.
    assert v.extra.tolist() == [2]
    v = verify(sjd, Independent(3), w, uniforms([[0.99, 0.85, 0.0]], [0.15]))
    assert v.accepted.tolist() == [2] and v.rejected.tolist() == [False]
    # Every draft passed: the bonus from q_2 (cdf 0.1, 0.2, 1.0) at u = 0.15 is token 1.
    assert v.extra.tolist() == [1]


@pytest.mark.parametrize(("u", "token"), [(0.7, 1), (0.8, 2)])
def test_the_residual_is_normalised_before_sampling(u, token):
    # Slot 0: draft 0, ratio 0.2 / 0.6 = 1/3; u 0.5 rejects. Residual [0, 0.3, 0.1] -> [0, .75,
    # .25]: u * 0.4 against the cdf [0, 0.3, 0.4].
    v = verify(sp.acceptance.get("sjd"), Independent(3), window([[0, 1]], DP, Q),
               uniforms([[0.5, 0.0, 0.0]], [u]))
    assert v.accepted.tolist() == [0] and v.extra.tolist() == [token]


def test_csd_relaxes_only_below_delta():
    # Slot 0: draft 0, ratio 1/3; H(q_0) = 1.0297 nats so the relaxed probability is
    # min(1, 1/3 + 0.5 * 1.0297) = 0.848; TV(p_0, q_0) = 0.4. A uniform of 0.8 lies between.
    h = -sum(p * math.log(p) for p in Q[0][0])
    assert 1 / 3 < 0.8 < 1 / 3 + 0.5 * h
    u, w = uniforms([[0.8, 0.99, 0.0]], [0.0]), window([[0, 1]], DP, Q)
    relaxed = verify(sp.acceptance.get("csd", lam=0.5, delta=0.5), Independent(3), w, u)
    strict = verify(sp.acceptance.get("csd", lam=0.5, delta=0.35), Independent(3), w, u)
    # TV 0.4 < delta 0.5: relaxed, accepted; slot 1 (ratio 0.9 + 0.5 * 1.03 nats) then too.
    assert relaxed.accepted.tolist() == [2]
    assert strict.accepted.tolist() == [0]  # TV 0.4 >= delta 0.35: the lossless test rejects
    assert strict.extra.tolist() == [1]  # residual [0, 0.3, 0.1] at u 0 -> token 1


def test_forced_drafts_are_accepted_whatever_the_rule_says():
    # Slot 1 forces token 0, whose ratio is 0.2 / (1/3) = 0.6; u = 0.99 would reject it.
    w = window([[1, 0]], DP, Q, forced=[[-1, 0]])
    v = verify(sp.acceptance.get("sjd"), Independent(3), w, uniforms([[0.0, 0.99, 0.0]], [0.95]))
    assert v.accepted.tolist() == [2] and v.extra.tolist() == [2]  # bonus: u 0.95 in q_2


def test_ragged_windows_stop_at_their_own_outputs():
    # Two windows; the second has 2 real outputs: one draft, then its bonus from q_1.
    w = window([[1, 1], [1, 1]], DP * 2, Q * 2, outputs=[3, 2], ragged=True)
    v = verify(sp.acceptance.get("sjd"), Maximal(3), w,
               uniforms([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [0.0, 0.99]))
    assert v.accepted.tolist() == [2, 1] and v.rejected.tolist() == [False, False]
    assert v.extra.tolist() == [0, 2]  # q_2 at u 0 -> 0; q_1 at u 0.99 -> 2
    # Ragged: the second window's slot 1 holds no draft, so the maximal coupling draws it
    # from the target (u_redraw 0.5 in q_1: cdf 0.2, 0.5 -> token 2) instead of keeping it.
    assert v.next_drafts[1, 1].item() == 2 and v.next_drafts[0, 1].item() == 1


def test_independent_coupling_redraws_every_tail_slot_from_its_target():
    w = window([[0, 1]], DP, Q)
    v = verify(sp.acceptance.get("sjd"), Independent(3), w,
               uniforms([[0.5, 0.0, 0.0]], [0.0], redraw=[[0.1, 0.1, 0.5]]))
    assert v.next_drafts.tolist() == [[0, 0, 2]]  # inverse cdf of q_0, q_1, q_2
    assert torch.equal(v.next_laws, w.target_probs)


@pytest.mark.parametrize("name", list(sp.acceptance.RULES))
def test_every_rule_commits_what_its_own_probabilities_say(tiny, name):
    """verify() accepts exactly where u < the rule's acceptance probability and samples the
    extra token from the rule's residual by inverse cdf."""
    rule = build_rule(tiny, name)
    g = torch.Generator().manual_seed(3)
    V, G, K = tiny.vocab_size, 16, 4
    dp = torch.rand(G, K, V, generator=g).softmax(-1)
    q = (3 * torch.rand(G, K + 1, V, generator=g)).softmax(-1)
    d = torch.multinomial(dp.view(-1, V), 1, generator=g).view(G, K)
    a = rule.compute_acceptance(d, dp, q[:, :K])
    u_acc = torch.rand(G, K, generator=g)
    u_extra = torch.rand(G, generator=g)
    w = Window(torch.arange(G), torch.arange(K + 1).expand(G, -1), d, dp, q, torch.full((G,), K + 1))
    v = verify(rule, Independent(V), w, Uniforms(torch.cat([u_acc, u_acc[:, :1]], 1),
                                                 torch.rand(G, K + 1, generator=g), u_extra,
                                                 torch.zeros(G, K + 1)))
    for i in range(G):
        ok = (u_acc[i] < a[i]).tolist() + [False]
        first = ok.index(False)
        assert v.accepted[i].item() == first
        law = (rule.compute_residual(dp[i, first][None, None], q[i, first][None, None],
                                     d[i, first][None, None])[0, 0] if first < K else q[i, K])
        cdf = law.cumsum(0)
        expected = min(int((cdf <= u_extra[i] * cdf[-1]).sum()), V - 1)
        assert v.extra[i].item() == expected


def test_settle_commits_and_keeps_the_right_slots():
    w = window([[0, 1], [1, 1]], DP * 2, Q * 2)
    v = verify(sp.acceptance.get("sjd"), Independent(3), w,
               uniforms([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], [0.7, 0.0],
                        redraw=[[0.1, 0.1, 0.5], [0.1, 0.1, 0.5]]))
    assert v.accepted.tolist() == [0, 2]
    # Raster (every window takes its extra token): window 0 commits the residual token at slot
    # 0 and keeps slots 1, 2 as drafts; window 1 commits both drafts and the bonus.
    c = settle(w, v, torch.tensor([True, True]))
    assert c.limit.tolist() == [0, 2]
    assert c.keep.tolist() == [[True, False, False], [True, True, True]]
    assert c.tail.tolist() == [[False, True, True], [False, False, False]]
    assert c.tokens[0].tolist() == [1, 0, 2] and c.tokens[1, :2].tolist() == [1, 1]
    assert c.drafted.tolist() == [[False, False, False], [True, True, False]]
    # A lower row defers its rejected slot: nothing committed, the slot stays a draft.
    c = settle(w, v, torch.tensor([False, False]))
    assert c.limit.tolist() == [-1, 2] and c.tail[0].tolist() == [True, True, True]
    assert c.tokens[0, 0].item() == 0  # the coupling's redraw of slot 0, not the residual
    # Lock step (batch_min): window 1 commits as little as window 0; its accepted drafts stay
    # drafts with their old laws.
    c = settle(w, v, torch.tensor([True, True]), limit=torch.tensor([0, 0]))
    assert c.tail[1].tolist() == [False, True, True]
    assert torch.equal(c.laws[1, 1], w.draft_probs[1, 1])


@pytest.mark.parametrize("method,options", [
    ("addition", {"eps": 0.3}), ("csd", {}), ("csd", {"lam": 2.0, "delta": 1.0}), ("gsd", {}),
    ("lantern", {}), ("amplify", {"k": 3.0})])
def test_no_relaxed_rule_commits_a_token_the_target_forbids(method, options):
    # Row ends: the end-of-row id (vocab_size) has target probability 0 at every image cell,
    # yet uniform fresh drafts propose it and every relaxed formula would keep some of them.
    m = sp.load_model("tiny", vocab_size=6, grid=(3, 4), seed=1, row_end=True)
    out = sp.generate(m, [3] * 80, method=method, window=8, draft_init="uniform", seed=0,
                      decode_images=False, **options)
    assert int(out.tokens.max()) < 6, method


def test_tv_is_exactly_one_for_disjoint_supports():
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(200, 8, generator=g), -1)
    target[:, 7] = 0
    target = target / target.sum(-1, keepdim=True)
    draft = torch.nn.functional.one_hot(torch.full((200,), 7), 8).float()
    assert (F.total_variation(draft, target) == 1.0).all()
    rule = sp.acceptance.get("csd", lam=5.0, delta=1.0)
    tokens = torch.full((200, 1), 7)
    assert (rule.acceptance_probs(tokens, draft[:, None], target[:, None]) == 0).all()


@pytest.mark.parametrize("method,options", [
    ("addition", {"eps": 0.5}), ("csd", {"lam": 3.0, "delta": 1.0}), ("gsd", {}),
    ("lantern", {"delta": 1.0}), ("amplify", {"k": 10.0})])
def test_a_token_outside_top_k_is_never_kept(tiny, method, options):
    rule = build_rule(tiny, method, **options)
    g = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(64, 1, 12, generator=g), -1)
    top = target.topk(3, -1).indices  # top-k 3: every other token has probability 0
    target = torch.zeros_like(target).scatter(-1, top, target.gather(-1, top))
    target = target / target.sum(-1, keepdim=True)
    draft = torch.full_like(target, 1 / 12)
    tokens = torch.randint(12, (64, 1), generator=g)
    outside = target.gather(-1, tokens[..., None])[..., 0] == 0
    assert outside.any()
    accept = rule.acceptance_probs(tokens, draft, target)
    assert (accept[outside] == 0).all()
    if method != "amplify":  # k * ratio is 0 there already; the additive formulas are not
        assert (rule.compute_acceptance(tokens, draft, target)[outside] > 0).any()
