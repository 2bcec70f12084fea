"""Each image of a batch advances on its own and does not depend on its batch-mates."""

import pytest
import torch

import speculaas as sp


@pytest.mark.parametrize("method", sp.METHODS)
def test_image_in_batch_equals_image_alone(tiny, method):
    prompts = [1, 5, None, 8]
    batch = sp.generate(tiny, prompts, method=method, seed=40, cfg_scale=2.0, window=6)
    for i, p in enumerate(prompts):
        alone = sp.generate(tiny, [p], method=method, seed=40 + i, cfg_scale=2.0, window=6)
        assert torch.equal(batch.tokens[i], alone.tokens[0]), (method, i)
        assert batch.forward_passes[i] == alone.forward_passes[0]


def test_explicit_per_image_seeds(tiny):
    # A fixed window: under "auto" a relaxed rule's window may differ between batch sizes
    # (the batch's slowest image prices the window), and with it the tokens.
    a = sp.generate(tiny, [1, 2], method="csd", seed=[7, 3], window=8)
    b = sp.generate(tiny, [2], method="csd", seed=3, window=8)
    c = sp.generate(tiny, [2], method="csd", seed=4, window=8)
    assert torch.equal(a.tokens[1], b.tokens[0]) and not torch.equal(b.tokens[0], c.tokens[0])
    with pytest.raises(ValueError, match="seeds"):
        sp.generate(tiny, [1, 2], seed=[1])


def test_images_advance_by_their_own_accepted_length(tiny):
    out = sp.generate(tiny, list(range(8)), method="sjd", seed=0, window=8)
    assert out.forward_passes.unique().numel() > 1  # not all held to one pace
    lockstep = sp.generate(tiny, list(range(8)), method="sjd", seed=0, window=8,
                           advance="batch_min")
    assert lockstep.forward_passes.unique().numel() == 1
    assert out.forward_passes.float().mean() < lockstep.forward_passes.float().mean()
