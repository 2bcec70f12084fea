"""Exact tier: hand-built probabilities for every functional kernel and rule."""

import math

import pytest
import torch
from conftest import ZERO_RELAXATION

import speculaas as sp
from speculaas.acceptance import functional as Fn

DRAFT = torch.tensor([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]])  # [1, 2, 3]
TARGET = torch.tensor([[[0.25, 0.5, 0.25], [0.9, 0.05, 0.05]]])
TOKENS = torch.tensor([[0, 2]])


def test_acceptance_ratio_and_sjd():
    ratio = Fn.acceptance_ratio(TOKENS, DRAFT, TARGET)
    assert torch.allclose(ratio, torch.tensor([[0.5, 0.15]]))
    rule = sp.acceptance.get("sjd")
    assert torch.allclose(
        rule.acceptance_probs(torch.tensor([[1, 0]]), DRAFT, TARGET), torch.tensor([[1.0, 1.0]])
    )  # ratios 2 and 2.7 are clipped at 1


def test_residual_and_all_zero_guard():
    res = Fn.residual_probs(DRAFT, TARGET)
    assert torch.allclose(res[0, 0], torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(res[0, 1], torch.tensor([1.0, 0.0, 0.0]))
    same = Fn.residual_probs(TARGET, TARGET)  # residual all zero -> falls back to the target
    assert torch.allclose(same, TARGET)


def test_entropy_tv_kl_first_rejection():
    assert torch.allclose(Fn.entropy(torch.tensor([0.5, 0.5, 0.0])), torch.tensor(math.log(2)))
    assert torch.allclose(Fn.total_variation(DRAFT, TARGET), torch.tensor([[0.25, 1.7 / 3]]))
    kl = Fn.kl_divergence(torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75]))
    assert torch.allclose(kl, torch.tensor(0.5 * math.log(2) + 0.5 * math.log(2 / 3)))
    acc = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert Fn.first_rejection(acc).tolist() == [2, 0, 4]


def test_csd_formula_filter_on_and_off():
    h0 = -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5))
    # slot 0: TV 0.25 < delta 0.3 -> relaxed: 0.5 + 0.1 * H; slot 1: TV 0.567 >= 0.3 -> plain 0.15
    rule = sp.acceptance.get("csd", lam=0.1, delta=0.3)
    got = rule.acceptance_probs(TOKENS, DRAFT, TARGET)
    assert torch.allclose(got, torch.tensor([[0.5 + 0.1 * h0, 0.15]]))
    # delta above both TVs: both relaxed; large lam saturates at 1
    h1 = -(0.9 * math.log(0.9) + 2 * 0.05 * math.log(0.05))
    got = sp.acceptance.get("csd", lam=0.1, delta=0.9).acceptance_probs(TOKENS, DRAFT, TARGET)
    assert torch.allclose(got, torch.tensor([[0.5 + 0.1 * h0, 0.15 + 0.1 * h1]]))
    assert torch.allclose(
        sp.acceptance.get("csd", lam=5.0, delta=0.9).acceptance_probs(TOKENS, DRAFT, TARGET),
        torch.ones(1, 2),
    )


def test_csd_kl_filters():
    kl = Fn.kl_divergence(DRAFT, TARGET)[0]
    rkl = Fn.kl_divergence(TARGET, DRAFT)[0]
    for name, d in (("kl", kl), ("rkl", rkl)):
        delta = float(d[0] + d[1]) / 2 if d[0] < d[1] else float(d[1]) / 2
        rule = sp.acceptance.get("csd", lam=0.1, delta=min(delta, 1.0), filter=name)
        got = rule.acceptance_probs(TOKENS, DRAFT, TARGET)[0]
        relaxed = got > Fn.acceptance_ratio(TOKENS, DRAFT, TARGET)[0] + 1e-6
        assert relaxed.tolist() == (d < min(delta, 1.0)).tolist()


def test_amplify_and_addition():
    assert torch.allclose(
        sp.acceptance.get("amplify", k=1.5).acceptance_probs(TOKENS, DRAFT, TARGET),
        torch.tensor([[0.75, 0.225]]),
    )
    assert torch.allclose(
        sp.acceptance.get("addition", eps=0.2).acceptance_probs(TOKENS, DRAFT, TARGET),
        torch.tensor([[0.7, 0.35]]),
    )


def test_gsd_groups_by_rank_probability_and_embedding():
    target = torch.tensor([[[0.30, 0.28, 0.02, 0.40]]])
    draft = torch.full((1, 1, 4), 0.25)
    x = torch.tensor([[1]])
    # ranks: 3 (0.40), 0 (0.30), 1 (0.28), 2 (0.02). group_size 3 around token 1: {0, 1, 2};
    # |q - 0.28| < 0.15 keeps 0 and 1 (and drops 2): ratio (0.30 + 0.28) / 0.5
    rule = sp.acceptance.get("gsd", group_size=3, prob_threshold=0.15)
    assert torch.allclose(rule.acceptance_probs(x, draft, target), torch.tensor([[1.0]]))
    emb = torch.tensor([[5.0, 0], [0, 0], [0, 0.1], [0, 0.2]])  # token 0 is far from token 1
    draft = torch.tensor([[[0.1, 0.5, 0.2, 0.2]]])
    plain = sp.acceptance.get("gsd", group_size=3, prob_threshold=0.15)
    assert torch.allclose(plain.acceptance_probs(x, draft, target), torch.tensor([[0.58 / 0.6]]))
    rule = sp.acceptance.get(
        "gsd", group_size=3, prob_threshold=0.15, dist_threshold=0.5, token_embeddings=emb
    )
    assert torch.allclose(rule.acceptance_probs(x, draft, target), torch.tensor([[0.56]]))
    single = sp.acceptance.get("gsd", group_size=1)
    assert torch.allclose(single.acceptance_probs(x, draft, target), torch.tensor([[0.56]]))


def test_lantern_borrows_neighbour_mass_within_budget():
    codebook = torch.tensor([[0.0], [1.0], [2.0], [10.0]])  # neighbours of 0: 1, 2, 3
    target = torch.tensor([[[0.1, 0.15, 0.1, 0.65]]])
    draft = torch.tensor([[[0.5, 0.2, 0.2, 0.1]]])
    x = torch.tensor([[0]])
    rule = sp.acceptance.get("lantern", k=3, delta=0.3, codebook=codebook)
    # cumulative neighbour mass 0.15, 0.25, 0.9 -> merge tokens 1 and 2 (0.25 <= 0.3)
    assert torch.allclose(rule.acceptance_probs(x, draft, target), torch.tensor([[0.35 / 0.5]]))
    # residual: relaxed target (0.35, 0, 0, 0.65) minus draft -> only token 3 survives
    res = rule.residual_probs(draft, target, x)
    assert torch.allclose(res, torch.tensor([[[0.0, 0.0, 0.0, 1.0]]]))
    zero = sp.acceptance.get("lantern", k=3, delta=0.0, codebook=codebook)
    assert torch.allclose(zero.acceptance_probs(x, draft, target), torch.tensor([[0.2]]))


@pytest.mark.parametrize("name,opts", ZERO_RELAXATION)
def test_zero_relaxation_equals_sjd_exactly(name, opts):
    gen = torch.Generator().manual_seed(0)
    draft = torch.rand(4, 6, 9, generator=gen).softmax(-1)
    target = (3 * torch.rand(4, 6, 9, generator=gen)).softmax(-1)
    tokens = torch.randint(9, (4, 6), generator=gen)
    a = sp.acceptance.get(name, **opts).acceptance_probs(tokens, draft, target)
    b = sp.acceptance.get("sjd").acceptance_probs(tokens, draft, target)
    assert torch.equal(a, b)
