"""Bad input gets a clear ValueError naming the problem."""

import copy

import pytest
import torch

import speculaas as sp


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "nope"}, "unknown method 'nope'"),
    ({"method": "csd", "lam": -0.1}, "lam must be a number >= 0"),
    ({"method": "csd", "delta": 1.5}, r"delta must be in \[0, 1\]"),
    ({"method": "csd", "filter": "l2"}, "unknown filter"),
    ({"method": "sjd", "lam": 0.5}, r"unknown option\(s\) \['lam'\] for method 'sjd'"),
    ({"method": "csd", "window": 0}, "window must be an integer >= 1"),
    ({"method": "csd", "window": 2.5}, "window must be an integer >= 1"),
    ({"method": "csd", "temperature": 0}, "temperature must be"),
    ({"method": "csd", "top_p": 0}, "top_p must be in"),
    ({"method": "csd", "top_k": -3}, "top_k must be a positive integer"),
    ({"method": "amplify", "k": 0.5}, "amplify k must be >= 1"),
    ({"method": "gsd", "group_size": 0}, "group_size must be an integer >= 1"),
    ({"method": "csd", "draft_init": "zeros"}, "unknown draft_init"),
    ({"method": "ar", "delta": 0.3}, "method 'ar' takes no options"),
])
def test_bad_options(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sp.generate(tiny, [1], **kwargs)


def test_bad_prompts_and_models(tiny, tmp_path):
    with pytest.raises(ValueError, match="class ids"):
        sp.generate(tiny, ["a cat"])
    with pytest.raises(ValueError, match="prompts is empty"):
        sp.generate(tiny, [])
    with pytest.raises(ValueError, match="unknown model 'janus-pro-9000'"):
        sp.load_model("janus-pro-9000")
    with pytest.raises(ValueError, match="grid must be"):
        sp.load_model("tiny", grid=(0, 3))
    with pytest.raises(ValueError, match=r"bad option\(s\) \['colour'\] for model 'tiny'"):
        sp.load_model("tiny", colour="red")
    with pytest.raises(ValueError, match="builtin.safetensors"):
        sp.load_model("builtin", str(tmp_path))


def test_rule_input_shapes():
    rule = sp.acceptance.get("sjd")
    probs = torch.full((1, 2, 4), 0.25)
    with pytest.raises(ValueError, match=r"must both be \[batch, window, vocab\]"):
        rule.acceptance_probs(torch.zeros(1, 2, dtype=torch.long), probs, probs[:, :1])
    with pytest.raises(ValueError, match="draft_tokens must be"):
        rule.acceptance_probs(torch.zeros(1, 3, dtype=torch.long), probs, probs)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
        rule.acceptance_probs(torch.tensor([[0, 9]]), probs, probs)
    with pytest.raises(ValueError, match="NaN"):
        rule.acceptance_probs(torch.zeros(1, 2, dtype=torch.long), probs * float("nan"), probs)
    with pytest.raises(ValueError, match="codebook"):
        sp.acceptance.get("lantern")


def test_nan_logits_are_reported(tiny):
    broken = copy.deepcopy(tiny)
    with torch.no_grad():
        broken.decoder.head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN logits"):
        sp.generate(broken, [1], method="csd")
