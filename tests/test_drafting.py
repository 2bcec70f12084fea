"""Drafters (fresh-slot initialisers and tail couplings): exact for every rule, greedy-equal to AR,
statistically lossless against the toy model's enumerated distribution, with plausible wrong
couplings as negative controls that the same test must reject.

A drafter's declared law matters only where a ratio test reads it: relaxed rules, and exact
rules under verify="ratio", which is what the statistical tests here run. Under Gumbel
verification (the default for exact rules) every committed token is the AR sample whatever the
drafts: tests/test_exact.py."""

from collections import Counter

import pytest
import torch
from scipy import stats
from test_statistical import ALPHA, N_SAMPLES, chi_square_p, sample_sequences

import speculaas as sp
from speculaas.acceptance.functional import acceptance_ratio, entropy
from speculaas.api import generators_for
from speculaas.config import COUPLINGS, DRAFT_INITS, JacobiConfig, SamplingConfig
from speculaas.decoding import decode, drafting
from speculaas.sampling import exponential_noise


class StaleDeclaration(drafting.Maximal):
    """Wrong on purpose (the public SCD code): a kept tail token declares the OLD draft
    distribution instead of the new target."""

    name = "stale"

    def redraft(self, t):
        tokens, q = super().redraft(t)
        k = t.drafts.shape[1]
        keep = t.u_keep[:, :k] < acceptance_ratio(t.drafts, t.draft_probs, q[:, :k])
        declared = torch.where(keep[..., None], t.draft_probs, q[:, :k])
        return tokens, torch.cat([declared, q[:, k:]], 1)


class RelaxedTail(drafting.Maximal):
    """Wrong on purpose: keeps tail tokens with a CSD-style relaxed test (ratio + 0.5 H)."""

    name = "relaxed-tail"

    def redraft(self, t):
        tokens, q = super().redraft(t)
        k = t.drafts.shape[1]
        ratio = acceptance_ratio(t.drafts, t.draft_probs, q[:, :k]) + 0.5 * entropy(q[:, :k])
        keep = t.u_keep[:, :k] < ratio
        return torch.cat([torch.where(keep, t.drafts, tokens[:, :k]), tokens[:, k:]], 1), q


@pytest.fixture
def with_broken_couplings(monkeypatch):
    for cls in (StaleDeclaration, RelaxedTail):
        monkeypatch.setitem(drafting.COUPLINGS, cls.name, cls)
    monkeypatch.setattr("speculaas.config.COUPLINGS", COUPLINGS + ("stale", "relaxed-tail"))


def test_config_names_match_the_registries():
    assert tuple(drafting.FRESH_INITS) == DRAFT_INITS
    assert tuple(drafting.COUPLINGS) == COUPLINGS


@pytest.fixture(scope="module")
def toy2d():
    # 2 rows of 2: "vertical" initialisers have a row above to copy from.
    return sp.load_model("toy", vocab_size=3, length=4, seed=0, rows=2)


CASES = [  # coupling, draft_init, window, sampling
    ("maximal", "uniform", 3, SamplingConfig()),
    ("maximal", "onehot", 16, SamplingConfig()),
    ("maximal", "vertical", 3, SamplingConfig()),
    ("maximal", "vertical_sample", 16, SamplingConfig(cfg_scale=2.0, top_k=2)),
    ("gumbel", "uniform", 16, SamplingConfig()),
    ("gumbel", "onehot", 3, SamplingConfig()),
    ("gumbel", "vertical", 16, SamplingConfig(cfg_scale=2.0, top_k=2)),
    ("gumbel", "vertical_sample", 3, SamplingConfig()),
    ("none", "vertical", 16, SamplingConfig()),
    ("none", "vertical_sample", 3, SamplingConfig(cfg_scale=2.0, top_k=2)),
]


@pytest.mark.parametrize("coupling,draft_init,window,sampling", CASES)
def test_drafters_are_lossless(toy2d, coupling, draft_init, window, sampling):
    jacobi = JacobiConfig(verify="ratio", window=window, draft_init=draft_init, coupling=coupling)
    counts = sample_sequences(toy2d, sp.acceptance.get("sjd"), jacobi, sampling)
    assert chi_square_p(counts, toy2d.exact_distribution(sampling)) > ALPHA


@pytest.mark.parametrize("coupling", ["maximal", "gumbel"])
def test_couplings_are_lossless_in_batches_of_4(coupling):
    toy = sp.load_model("toy", vocab_size=3, length=4, seed=0, scale=0.8, rows=2)
    sampling = SamplingConfig(cfg_scale=1.5)
    jacobi = JacobiConfig(verify="ratio", window=4, draft_init="vertical_sample", coupling=coupling)
    counts, uneven = Counter(), 0
    for i in range(1500):
        res = decode(toy, toy.start([None] * 4, cfg=True), sp.acceptance.get("sjd"),
                            sampling, jacobi, generators_for(toy, 4 * i, 4))
        counts.update(map(tuple, res.tokens.tolist()))
        uneven += int(res.forward_passes.min() != res.forward_passes.max())
    assert chi_square_p(counts, toy.exact_distribution(sampling)) > ALPHA
    assert uneven > 1500 // 10


@pytest.mark.parametrize("coupling", ["stale", "relaxed-tail"])
def test_wrong_couplings_fail(with_broken_couplings, coupling):
    toy = sp.load_model("toy", vocab_size=3, length=4, seed=0)
    sampling = SamplingConfig()
    counts = sample_sequences(toy, sp.acceptance.get("sjd"),
                              JacobiConfig(verify="ratio", window=16, coupling=coupling), sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) < ALPHA


def test_relaxed_rule_one_slot_law_matches_closed_form():
    """CSD at one slot outputs p*b + (1 - sum p*b) * residual (p: declared draft, b: CSD's
    acceptance). Position 0 of the toy model is drafted from the uniform fresh-slot law, so its
    marginal through the whole loop must match that closed form, not the target."""
    toy = sp.load_model("toy", vocab_size=3, length=2, seed=4, scale=1.5)
    rule = sp.acceptance.get("csd", lam=0.5, delta=1.0)
    session = toy.start([None] * N_SAMPLES, cfg=False)
    res = decode(toy, session, rule, SamplingConfig(), JacobiConfig(verify="ratio", window=2),
                        generators_for(toy, 0, N_SAMPLES))
    observed = torch.bincount(res.tokens[:, 0], minlength=3).double()
    target = toy.table[0].softmax(-1)[None, None]  # [1, 1, V] target of position 0
    draft = torch.full_like(target, 1 / 3)
    tokens = torch.arange(3)[None]
    b = rule.acceptance_probs(tokens, draft.expand(1, 3, 3), target.expand(1, 3, 3))[0]
    residual = rule.residual_probs(draft, target)[0, 0]
    law = (draft[0, 0] * b + (1 - (draft[0, 0] * b).sum()) * residual).double()
    assert stats.chisquare(observed, law / law.sum() * N_SAMPLES).pvalue > ALPHA
    # and the relaxation is real: the target itself is rejected by the same test
    exact = target[0, 0].double()
    assert stats.chisquare(observed, exact / exact.sum() * N_SAMPLES).pvalue < ALPHA


# Rules that are exact under greedy targets (the relaxed baselines at zero relaxation).
GREEDY_EXACT = [("sjd", {}), ("csd", {}), ("gsd", {}), ("lantern", {}), ("amplify", {"k": 1.0}),
                ("addition", {"eps": 0.0})]
DRAFTERS = [(i, c) for i in DRAFT_INITS for c in COUPLINGS]


@pytest.mark.parametrize("window", [1, 4, 16, 64])
def test_greedy_equals_ar_for_every_drafter_and_rule(tiny, window):
    # Rotating pairing: each drafter meets four rules, each rule eight drafters.
    prompts = [3, None]
    ar = sp.generate(tiny, prompts, method="ar", top_k=1, cfg_scale=2.0)
    shift = [1, 4, 16, 64].index(window)
    for i, (draft_init, coupling) in enumerate(DRAFTERS):
        method, options = GREEDY_EXACT[(i + shift) % len(GREEDY_EXACT)]
        out = sp.generate(tiny, prompts, method=method, top_k=1, cfg_scale=2.0, window=window,
                          draft_init=draft_init, coupling=coupling, seed=7, decode_images=False,
                          **options)
        assert torch.equal(out.tokens, ar.tokens), (method, draft_init, coupling)


def test_drafters_with_forced_row_ends_and_long_windows():
    model = sp.load_model("tiny", vocab_size=6, grid=(3, 4), seed=1, row_end=True)
    ar = sp.generate(model, [0, 1], method="ar", top_k=1)
    for window in (5, 128):
        for draft_init in DRAFT_INITS:
            for coupling in COUPLINGS:
                out = sp.generate(model, [0, 1], method="csd", top_k=1, window=window,
                                  draft_init=draft_init, coupling=coupling)
                assert torch.equal(out.sequence, ar.sequence), (window, draft_init, coupling)


def test_gumbel_noise_is_fixed_per_position_and_independent_across_keys():
    keys = torch.tensor([1, 2])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2]])
    e = exponential_noise(keys, pos, 4096)
    assert e.dtype == torch.float32 and (e > 1e-10).all()
    assert torch.equal(e[:, 1:], exponential_noise(keys, pos[:, 1:], 4096))
    g = -e.log()
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0, 0], g[0, 1])
    # a standard Gumbel: mean 0.5772, variance pi^2 / 6
    assert abs(g.mean().item() - 0.5772) < 0.02 and abs(g.var().item() - 1.6449) < 0.05


# Key 1 hashes (position 2192, token 5545) to 2**32 - 93: in float32, (h + 0.5) / 2**32 is 1.0.
HOT_KEY, HOT_POS, HOT_TOKEN = 1, 2192, 5545


def test_gumbel_noise_is_finite_where_float32_rounds_to_one():
    from speculaas.sampling import _hash32

    keys, pos = torch.tensor([HOT_KEY]), torch.tensor([[HOT_POS]])
    v = torch.tensor([HOT_TOKEN * 0x9E3779B1 & 0xFFFFFFFF])
    base = _hash32((keys[:, None] + _hash32((pos + 0x632BE5AB) & 0xFFFFFFFF)) & 0xFFFFFFFF)
    h = _hash32(base[..., None] ^ v)
    assert (h.float() + 0.5) * (1.0 / 2**32) == 1.0  # the old conversion's infinite noise
    e = exponential_noise(keys, pos, 8192)
    assert (e > 0).all() and torch.isfinite(e).all() and -e[0, 0, HOT_TOKEN].log() > 17


def test_gumbel_coupling_never_drafts_a_token_the_target_excludes():
    """With infinite noise the token became the draft whatever the target said (outside the
    top-k: declared probability 0, so the slot committed from the residual)."""
    vocab = 8192
    q = torch.full((1, 2, vocab), 1.0 / (vocab - 1), dtype=torch.float32)
    q[..., HOT_TOKEN] = 0.0
    pos = torch.tensor([[HOT_POS - 1, HOT_POS]])
    noise = exponential_noise(torch.tensor([HOT_KEY]), pos, vocab)
    tail = drafting.Tail(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), q[:, :1],
                         q, pos, torch.zeros(1, 2), torch.zeros(1, 2), noise=noise)
    tokens, _ = drafting.GumbelShared(vocab).redraft(tail)
    assert int(tokens[0, 1]) != HOT_TOKEN


class UniformlyDeclaredVerticalSample(drafting.VerticalSampleInit):
    """Wrong on purpose: samples from the distribution above but declares it uniform."""

    name = "vertical_sample-uniform-law"

    def fill(self, s):
        tokens, probs = super().fill(s)
        return tokens, self._uniform_probs(s).expand_as(probs)


@pytest.fixture
def toy3x2():
    # 3 rows of 2 over a binary vocabulary: fresh slots whose row above is committed or a draft
    # still in the window are verified at windows 3 and 4.
    return sp.load_model("toy", vocab_size=2, length=6, seed=1, rows=3)


@pytest.mark.parametrize(("draft_init", "coupling", "window", "exact"), [
    ("vertical_sample", "none", 3, True), ("vertical_sample", "maximal", 4, True),
    ("vertical", "maximal", 3, True), ("vertical_sample-uniform-law", "none", 3, False),
])
def test_drafts_from_the_row_above_are_exact(toy3x2, monkeypatch, draft_init, coupling, window,
                                             exact):
    """Fresh drafts really taken from the row above (asserted), verified: the declared law
    keeps SJD exact; declaring the wrong law (the negative control) is caught."""
    monkeypatch.setitem(drafting.FRESH_INITS, UniformlyDeclaredVerticalSample.name,
                        UniformlyDeclaredVerticalSample)
    monkeypatch.setattr("speculaas.config.DRAFT_INITS",
                        DRAFT_INITS + (UniformlyDeclaredVerticalSample.name,))
    from_above = {"committed": 0, "draft": 0}
    above = drafting.FreshInit._above

    def counted(self, s):  # noqa: ANN001, ANN202
        src, has, committed = above(self, s)
        verified = s.fresh & has & (s.pos < toy3x2.layout.length - 1)  # a draft slot tested
        from_above["committed"] += int((verified & committed).sum())
        from_above["draft"] += int((verified & ~committed).sum())
        return src, has, committed

    monkeypatch.setattr(drafting.FreshInit, "_above", counted)
    sampling = SamplingConfig()
    counts = sample_sequences(toy3x2, sp.acceptance.get("sjd"),
                              JacobiConfig(verify="ratio", window=window, draft_init=draft_init,
                                           coupling=coupling), sampling)
    p = chi_square_p(counts, toy3x2.exact_distribution(sampling))
    assert from_above["committed"] > 1000 and (window == 3 or from_above["draft"] > 1000)
    assert (p > ALPHA) if exact else (p < ALPHA), (p, from_above)
