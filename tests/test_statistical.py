"""Statistical tier: the output distribution of AR (Gumbel-max sampling) and SJD (both ways of
verifying) equals the exact AR distribution of an enumerable toy model (chi-square, significance
0.001); deliberately broken variants must fail the same test."""

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from scipy import stats

import speculaas as sp
from speculaas.acceptance.base import AcceptanceRule
from speculaas.api import generators_for
from speculaas.config import JacobiConfig, SamplingConfig
from speculaas.decoding import autoregressive, autoregressive_decode, decode
from speculaas.sampling import exponential_noise

ALPHA = 1e-3
N_SAMPLES = 24_000
N_BATCHED = 6_000  # one call per 4-image batch: slower per sample


@dataclass(frozen=True)
class AcceptEverything(AcceptanceRule):
    """Broken on purpose: keeps every draft."""

    name = "broken"

    def compute_acceptance(self, draft_tokens, draft_probs, target_probs):
        return torch.ones_like(draft_tokens, dtype=target_probs.dtype)


@dataclass(frozen=True)
class ResampleFromTarget(AcceptanceRule):
    """Broken on purpose: correct test, but resamples from the target instead of the residual."""

    name = "broken-residual"

    def compute_residual(self, draft_probs, target_probs, draft_tokens=None):
        return target_probs


def sample_sequences(model, rule, jacobi, sampling, n=N_SAMPLES, chunk=6000, seed=0):
    counts = Counter()
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        session = model.start([None] * b, cfg=sampling.uses_cfg)
        gens = generators_for(model, seed + start, b)
        res = (autoregressive_decode(model, session, sampling, gens) if rule is None
               else decode(model, session, rule, sampling, jacobi, gens))
        counts.update(map(tuple, res.tokens.tolist()))
    return counts


def chi_square_p(counts, exact):
    n = sum(counts.values())
    keys = sorted(exact, key=exact.get, reverse=True)
    obs, exp, o_tail, e_tail = [], [], 0.0, 0.0
    for k in keys:  # pool the rare sequences so every bin expects at least 5
        if exact[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(exact[k] * n)
        else:
            o_tail += counts.get(k, 0)
            e_tail += exact[k] * n
    if e_tail > 0:
        obs.append(o_tail)
        exp.append(e_tail)
    scale = sum(obs) / sum(exp)  # exact probabilities sum to 1 only up to rounding
    return stats.chisquare(obs, [e * scale for e in exp]).pvalue


@pytest.fixture(scope="module")
def toy():
    return sp.load_model("toy", vocab_size=3, length=4, seed=0)


@pytest.mark.parametrize("window,draft_init,coupling,verify", [
    (16, "uniform", "none", "ratio"), (3, "uniform", "maximal", "ratio"),
    (3, "onehot", "none", "ratio"), (4, "vertical", "maximal", "gumbel")])
def test_sjd_matches_exact_distribution(toy, window, draft_init, coupling, verify):
    sampling = SamplingConfig()
    jacobi = JacobiConfig(window=window, draft_init=draft_init, coupling=coupling, verify=verify)
    counts = sample_sequences(toy, sp.acceptance.get("sjd"), jacobi, sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) > ALPHA


def test_ar_gumbel_max_matches_exact_distribution(toy):
    sampling = SamplingConfig(temperature=0.8)
    counts = sample_sequences(toy, None, None, sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) > ALPHA


def test_ar_with_noise_shared_across_positions_fails(toy, monkeypatch):
    """Negative control: one Gumbel draw per image reused at every position (a hash that
    forgets the position) couples the tokens of an image; the same test must reject it."""
    monkeypatch.setattr(autoregressive, "exponential_noise",
                        lambda keys, pos, vocab: exponential_noise(keys, pos * 0, vocab))
    sampling = SamplingConfig(temperature=0.8)
    counts = sample_sequences(toy, None, None, sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) < ALPHA


def test_sjd_matches_exact_distribution_with_top_k_and_temperature(toy):
    sampling = SamplingConfig(temperature=0.7, top_k=2)
    counts = sample_sequences(toy, sp.acceptance.get("sjd"), JacobiConfig(window=4), sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) > ALPHA


def test_acceptance_is_mixed_so_the_test_has_power(toy):
    session = toy.start([None] * 2000, cfg=False)
    res = decode(toy, session, sp.acceptance.get("sjd"), SamplingConfig(),
                        JacobiConfig(window=4), generators_for(toy, 0, 2000))
    share = res.drafted.float().mean().item()
    assert 0.1 < share < 0.9, share


@pytest.mark.parametrize("rule", [AcceptEverything(), ResampleFromTarget()])
def test_broken_rules_fail(toy, rule):
    sampling = SamplingConfig()
    counts = sample_sequences(toy, rule, JacobiConfig(window=4, verify="ratio"), sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) < ALPHA


@pytest.mark.parametrize("rule,advance,lossless", [
    (sp.acceptance.get("sjd"), "per_image", True), (AcceptEverything(), "per_image", False),
    (sp.acceptance.get("sjd"), "batch_min", False)])
def test_lossless_at_batch_4_with_each_image_advancing_on_its_own(rule, advance, lossless):
    """One call per batch of 4 images, so the images of a batch accept different numbers of
    drafts in the same iteration (checked below) and must still each be exact AR samples. The
    reference code's lock step (every image advances by the batch's minimum) re-tests accepted
    drafts against their old draft law: the same test must reject it (p ~ 1e-10 here). (Under
    Gumbel verification lock step is exact: tests/test_exact.py.)"""
    toy = sp.load_model("toy", vocab_size=3, length=4, seed=0, scale=0.8)
    sampling = SamplingConfig()
    counts, uneven = Counter(), 0
    for i in range(N_BATCHED // 4):
        session = toy.start([None] * 4, cfg=False)
        res = decode(toy, session, rule, sampling,
                     JacobiConfig(window=4, verify="ratio", advance=advance),
                     generators_for(toy, 4 * i, 4))
        counts.update(map(tuple, res.tokens.tolist()))
        uneven += int(res.forward_passes.min() != res.forward_passes.max())
    p = chi_square_p(counts, toy.exact_distribution(sampling))
    assert (p > ALPHA) if lossless else (p < ALPHA), p
    if lossless:  # the images of a batch really advanced by different amounts
        assert uneven > N_BATCHED // 40
