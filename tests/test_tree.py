"""Candidate trees at the window head (decoding/tree.py): the layout, the tree attention mask,
sample-exact decoding (sjd with a tree draws AR's tokens), exactness in distribution under the
ratio test (chi-square on the toy model, with negative controls), the window policy's choice,
and the refusals."""

import subprocess
import sys

import pytest
import torch
from conftest import assert_same_as_ar
from test_statistical import ALPHA, N_SAMPLES, AcceptEverything, chi_square_p, sample_sequences

import speculaas as sp
from speculaas.config import JacobiConfig, SamplingConfig, parse_tree
from speculaas.decoding import tree as tree_mod
from speculaas.decoding.tree import TREE_WIDTHS, TreeShape, likely_paths, tree_layout
from speculaas.decoding.window import CANDIDATES, AutoWindow


def test_layout_keeps_the_likeliest_paths_and_masks_ancestors():
    full = likely_paths(3, 3, 3 + 9 + 27 - 3)  # every off-chain path of the full tree
    assert len(full) == len(set(full)) == 36 and all(any(p) for p in full)
    pruned = likely_paths(4, 6, 20)
    assert len(pruned) == 20
    for p in pruned:  # prefix-closed: every ancestor is a node or on the chain
        for n in range(1, len(p)):
            assert p[:n] in pruned or not any(p[:n])
    assert max(map(len, pruned)) == 3  # deeper than the full 4-ary tree (18 nodes at depth 2)
    sh = TreeShape.build(4, 6, 64, 20)
    assert sh.main == 44 and len(sh.depth) == 64
    for s in range(sh.main, 64):  # a node sees exactly its ancestors and itself
        seen, a = set(), s
        while a >= 0:
            seen.add(a)
            a = int(sh.parent[a])
        assert set(sh.mask[s].nonzero()[:, 0].tolist()) == seen
        assert int(sh.depth[s]) == len(seen) - 1
    assert torch.equal(sh.mask[: sh.main, : sh.main],
                       torch.ones(sh.main, sh.main, dtype=torch.bool).tril())
    assert tree_layout((4, 6, None), 64).off == 32  # the default: half the window


def _tree_forward(session, inputs, depth, mask, start, length, off):
    """One packed tree forward of image 0: slots [anchor, chain, off-chain nodes]."""
    n = len(depth)
    pos = torch.tensor([[start - 1 + d for d in depth]])
    visible = (torch.arange(length) < start)[None, None].expand(1, n, length)
    store = torch.tensor([[i < n - off for i in range(n)]])
    cond, _ = session.forward_packed(torch.tensor([inputs]), pos, torch.tensor([0]), visible,
                                     mask[None], store, off)
    return cond[0]


def assert_branches_independent(model, prompt=3):
    """Chain [anchor, a, b] and two branches hanging off the anchor, [y1, y2] and [x1, x2].
    Changing y's tokens leaves x's logits bit for bit the same (and the chain's); a plain
    causal mask over all slots (the negative control) lets x see y and changes them."""
    length = model.layout.length
    depth = [0, 1, 2, 1, 2, 1, 2]
    parent = [-1, 0, 1, 0, 3, 0, 5]
    mask = torch.zeros(7, 7, dtype=torch.bool)
    for s in range(7):
        a = s
        while a >= 0:
            mask[s, a] = True
            a = parent[a]

    def run(y, m):
        session = model.start([prompt], cfg=False)
        session.forward(torch.tensor([[0, 1, 2, 3]]), torch.tensor([0]), torch.tensor([0]))
        return _tree_forward(session, [3, 4, 5, *y, 6, 7], depth, m, 4, length, 4)

    x = [0, 1, 2, 5, 6]  # the chain and branch x (slots 5, 6); branch y sits in slots 3, 4
    one, two = run([8, 9], mask), run([10, 11], mask)
    assert torch.equal(one[x], two[x])
    assert not torch.equal(one[3:5], two[3:5])
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    one, two = run([8, 9], causal), run([10, 11], causal)
    assert not torch.equal(one[5:], two[5:])


def test_changing_a_branch_leaves_its_sibling_exactly_as_it_was(tiny, builtin):
    assert_branches_independent(tiny)
    assert_branches_independent(builtin, "a big red circle on the left over grass")


TREES = [((2, 1), 4), ((3, 2), 16), ((4, 6, 5), 12), ((4, 6), 64), ((2, 3), 256)]


@pytest.mark.parametrize("sampling", [{}, {"cfg_scale": 2.0, "top_k": 5},
                                      {"temperature": 0.7, "top_p": 0.9}])
def test_tiny_sjd_with_a_tree_draws_the_tokens_ar_draws(tiny, sampling):
    prompts = [3, None, 7, 1]
    for batch in (1, 4):
        for tree, window in TREES:
            assert_same_as_ar(tiny, prompts[:batch], windows=(window,), seed=batch, tree=tree,
                              **sampling)


def test_deep_walks_draw_the_tokens_ar_draws():
    """A vocabulary of 4 with 4 candidates per position: nearly every committed token is a
    candidate, so walks go down to depth 5 and every lookup of the walk is exercised."""
    small = sp.load_model("tiny", vocab_size=4, grid=(4, 6), seed=2)
    for seed in range(3):
        assert_same_as_ar(small, [1, 2, None, 4], windows=(24, 64), seed=seed, tree=(4, 5),
                          temperature=2.0)


def test_builtin_sjd_with_a_tree_draws_the_tokens_ar_draws(builtin):
    captions = ["a big red circle on the left over grass",
                "a small blue square on the right at sunset"]
    assert_same_as_ar(builtin, captions, windows=(64,), seed=11, tree=(4, 6))
    assert_same_as_ar(builtin, captions[:1], windows=(128,), seed=3, tree=(3, 3))


def test_trees_save_forwards_on_the_builtin_model(builtin):
    captions = ["a big red circle on the left over grass",
                "a small blue square on the right at sunset",
                "a big white diamond on the center in front of a brick wall"]
    chain = sp.generate(builtin, captions, method="sjd", window=32, seed=0, decode_images=False)
    tree = sp.generate(builtin, captions, method="sjd", window=64, tree=(4, 6), seed=0,
                       decode_images=False)  # the same 32-slot chain plus 32 tree nodes
    assert tree.forward_passes.sum() < chain.forward_passes.sum()


class WrongContextTree(tree_mod.Tree):
    """Broken on purpose: every off-chain node reports the chain's output at its depth (as if
    the mask let it see the chain instead of its own branch)."""

    def forward(self, session, plan, state, drafts):
        out = super().forward(session, plan, state, drafts)
        cond, uncond = self.logits
        sh = self.shape
        cond = cond.clone()
        cond[:, sh.main :] = cond[:, sh.depth[sh.main :].clamp(max=drafts.shape[1])]
        self.logits = (cond, uncond)
        return out


@pytest.fixture
def toy():
    return sp.load_model("toy", vocab_size=3, length=4, seed=0, packed=True)


# The first case draws 4x the samples: an off-chain rejection that resamples from the target
# instead of the rule's residual passes at 24k samples (p ~ 0.01) and fails at 96k (p ~ 1e-12).
@pytest.mark.parametrize("method,options,tree,window,n", [
    ("sjd", {}, (3, 2), 8, 4 * N_SAMPLES), ("sjd", {}, (2, 3, 3), 8, N_SAMPLES),
    ("csd", {"lam": 0.0}, (3, 3), 16, N_SAMPLES)])
def test_tree_under_the_ratio_test_matches_the_exact_distribution(toy, method, options, tree,
                                                                   window, n):
    sampling = SamplingConfig()
    rule = sp.acceptance.get(method, **options)
    jacobi = JacobiConfig(window=window, tree=tree, verify="ratio")
    counts = sample_sequences(toy, rule, jacobi, sampling, n=n)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) > ALPHA


def test_the_walk_really_commits_off_the_chain(toy):
    """The statistical test has power over the walk: trees save forwards on the toy."""
    sampling, rule = SamplingConfig(), sp.acceptance.get("sjd")
    gens = sp.api.generators_for(toy, 0, 2000)
    fwd = {}
    for tree in (None, (3, 2)):
        session = toy.start([None] * 2000, cfg=False)
        res = sp.decoding.decode(toy, session, rule, sampling,
                                 JacobiConfig(window=8, tree=tree, verify="ratio"), gens)
        fwd[tree] = res.forward_passes.float().mean().item()
        gens = sp.api.generators_for(toy, 0, 2000)
    assert fwd[(3, 2)] < 0.95 * fwd[None], fwd


def test_broken_trees_fail(toy, monkeypatch):
    sampling = SamplingConfig()
    jacobi = JacobiConfig(window=8, tree=(3, 2), verify="ratio")
    counts = sample_sequences(toy, AcceptEverything(), jacobi, sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) < ALPHA
    monkeypatch.setattr(sp.decoding.loop, "Tree", WrongContextTree)
    counts = sample_sequences(toy, sp.acceptance.get("sjd"), jacobi, sampling)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) < ALPHA


def test_auto_runs_a_tree_only_where_the_cost_curve_says_it_pays(builtin):
    caption = ["a big red circle on the left over grass"]
    widths = (0, *CANDIDATES, *TREE_WIDTHS)
    flat = AutoWindow(cost={w: 0.01 for w in widths})  # a GPU: a wide forward costs one step
    out = sp.generate(builtin, caption, method="sjd", window=flat, tree=(4, 6), seed=0,
                      decode_images=False)
    assert list(out.windows[0]) == [max(TREE_WIDTHS)]
    ar = sp.generate(builtin, caption, method="ar", seed=0, decode_images=False)
    assert torch.equal(out.tokens, ar.tokens)
    steep = AutoWindow(cost={w: 0.002 * (1 + w / 4) for w in widths})  # compute-bound
    out = sp.generate(builtin, caption, method="sjd", window=steep, tree=(4, 6), seed=0,
                      decode_images=False)
    assert max(out.windows[0]) <= 64  # the chain's windows, never the tree's widths


@pytest.mark.parametrize("tree,message", [
    ("4", "tree must be"), ("a,b", "tree must be K,D"), ((1, 3), "K >= 2"), ((3, 0), "D >= 1"),
    ((3, 3, 0), "1 <= N"), ((3, 3, 500), "1 <= N"), ((True, 2), "tree must be")])
def test_bad_trees_are_refused(tree, message):
    with pytest.raises(ValueError, match=message):
        parse_tree(tree)


def test_models_and_windows_that_cannot_take_a_tree_are_refused(tiny):
    with pytest.raises(ValueError, match="cannot take a tree attention mask"):
        sp.generate(sp.load_model("toy"), [None], method="sjd", window=8, tree=(2, 2))
    with pytest.raises(ValueError, match="structural tokens"):
        sp.generate(sp.load_model("tiny", row_end=True), [1], method="sjd", window=16,
                    tree=(2, 2))
    with pytest.raises(ValueError, match="needs 14 slots"):
        sp.generate(tiny, [1], method="sjd", window=8, tree=(3, 3, 10))
    with pytest.raises(ValueError, match="cannot be combined"):
        sp.generate(tiny, [1], method="sjd", window=8, tree=(2, 2), row_context=2)
    assert parse_tree("4x6x20") == (4, 6, 20) and parse_tree([3, 2]) == (3, 2, None)


def test_cli_tree(tmp_path):
    run = [sys.executable, "-m", "speculaas.cli", "generate", "--model", "tiny", "--prompt", "3",
           "--method", "sjd", "--window", "16", "--out", str(tmp_path / "t.png")]
    ok = subprocess.run(run + ["--tree", "3,2"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    ar = subprocess.run(run[:9] + ["ar", "--out", str(tmp_path / "a.png")], capture_output=True,
                        text=True)
    assert ar.returncode == 0
    assert (tmp_path / "t.png").read_bytes() == (tmp_path / "a.png").read_bytes()
    bad = subprocess.run(run + ["--tree", "1,3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "K >= 2" in bad.stderr
