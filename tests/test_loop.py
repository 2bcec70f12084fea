"""The decoding loop's own contract: at most one host synchronisation per iteration, whatever
the decoding order, rule or drafter."""

import pytest
import torch

import speculaas as sp
from speculaas.decoding import loop as loop_module

SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
         "numpy")


def _count_syncs_per_step(monkeypatch) -> list[int]:  # noqa: ANN001
    """Patch every tensor method that reads the device back to the host; record, per call of
    Loop.step, how many of them ran."""
    counts: list[int] = []
    inside = [False]
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, __original=original, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if inside[0]:
                counts[-1] += 1
            return __original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    step = loop_module.Loop.step

    def counted_step(self):  # noqa: ANN001, ANN202
        counts.append(0)
        inside[0] = True
        try:
            return step(self)
        finally:
            inside[0] = False

    monkeypatch.setattr(loop_module.Loop, "step", counted_step)
    return counts


@pytest.mark.parametrize(("method", "options"), [
    ("csd", {"window": 16}),
    ("sjd", {"window": 16, "draft_init": "vertical_sample", "coupling": "gumbel"}),
    ("gsd", {"window": 8, "advance": "batch_min"}),
    ("lantern", {"window": 16, "coupling": "maximal"}),
    ("csd", {"window": 16, "row_context": 4}),
])
def test_one_host_synchronisation_per_iteration(builtin, monkeypatch, method, options):
    counts = _count_syncs_per_step(monkeypatch)
    captions = ["a big red circle on the left over grass",
                "a small blue square on the right at sunset"]
    out = sp.generate(builtin, captions, method=method, seed=0, decode_images=False, **options)
    assert len(counts) == int(out.forward_passes.max()) + 1  # the last finds all finished
    assert max(counts) == 1, counts[:20]
