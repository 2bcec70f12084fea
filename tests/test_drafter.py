"""Trained draft heads: every rule keeps its law with a head drafting (sjd draws ar's tokens;
the ratio test's one-sequence law is the exact one, and a head that declares another law than
the one it drew from fails), heads are tied to their target, training resumes to the same
weights."""

import json

import pytest
import torch
from test_statistical import ALPHA, chi_square_p

import speculaas as sp
from speculaas.api import generators_for
from speculaas.config import JacobiConfig, SamplingConfig
from speculaas.decoding import decode
from speculaas.decoding.drafting import HeadDrafter
from speculaas.drafter.head import DraftHead, HeadConfig, load_head, save_head
from speculaas.drafter.train import TrainConfig, train_drafter

TINY = dict(vocab_size=16, grid=(4, 4), num_classes=4, d_model=32, n_layers=2, n_heads=2)
FAST = TrainConfig(images=48, batch=16, steps=30, chains=32, unroll=3, width=32, blocks=1,
                   depth=3, stale=True, prior_prompts=2, checkpoint_every=10)


@pytest.fixture(scope="module")
def tiny():
    return sp.load_model("tiny", **TINY)


@pytest.fixture(scope="module")
def tiny_head(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("head")
    sampling = SamplingConfig(cfg_scale=2.0, top_k=12)
    train_drafter(tiny, folder, FAST, sampling, progress=False, log=lambda *a: None)
    return folder


def random_head(model, depth=4, scale=1.0, seed=0, stale=False):
    """An untrained head tied to `model` (a poor drafter: what exactness must survive)."""
    io = model.draft_io()
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig(dim=io.dim, width=16, blocks=1, length=model.layout.length,
                                stride=model.layout.length // model.layout.grid[0],
                                vocab=model.vocab_size, depth=depth, stale=stale))
    with torch.no_grad():
        head.out[1].weight.mul_(scale)
    head.target = {"model": model.name, "fingerprint": io.fingerprint,
                   "weights_sha256": "0" * 64}
    return head.to(model.device).eval()


def test_training_writes_a_head_tied_to_its_target(tiny, tiny_head):
    record = json.loads((tiny_head / "head.json").read_text())
    assert record["model"] == "tiny" and record["fingerprint"] == tiny.draft_io().fingerprint
    assert set(record["prior"]) == {"lossless", "relaxed"}
    assert len(record["training"]["heldout"]["agreement"]) == FAST.unroll
    assert set(record["training"]["heldout"]["after_rejection"]) == {
        "agreement", "without_stale_feature"}
    head = load_head(tiny_head, tiny)
    assert head.cfg.depth == FAST.depth and head.target["sampling"]["cfg_scale"] == 2.0
    assert head.cfg.stale  # its first step reads the stale feature (the others' do not)


@pytest.mark.parametrize("window,tree", [(4, None), (16, None), ("auto", None), (8, (3, 3)),
                                         ("auto", (2, 4))])
@pytest.mark.parametrize("batch", [1, 4])
def test_sjd_with_a_head_draws_ar_tokens(tiny, tiny_head, window, tree, batch):
    prompts = [i % 4 for i in range(batch)]
    seeds = list(range(10, 10 + batch))
    opts = dict(cfg_scale=2.0, top_k=12, decode_images=False)
    ar = sp.generate(tiny, prompts, method="ar", seed=seeds, **opts)
    for head in (tiny_head, random_head(tiny, depth=6), random_head(tiny, depth=3, stale=True)):
        out = sp.generate(tiny, prompts, method="sjd", seed=seeds, window=window, tree=tree,
                          drafter=head, **opts)
        assert torch.equal(out.tokens, ar.tokens)


def test_sjd_with_a_head_on_the_builtin_model_and_row_ends(builtin):
    """The shipped head on the built-in model (random heads: on the tiny models, above)."""
    prompts = ["a big red circle on the left over grass", "a small blue square on the right"]
    ar = sp.generate(builtin, prompts, method="ar", seed=[3, 4], decode_images=False)
    out = sp.generate(builtin, prompts, method="sjd", seed=[3, 4], window=8, drafter="shipped",
                      decode_images=False)
    assert torch.equal(out.tokens, ar.tokens)
    shipped = load_head("shipped", builtin)  # tied to these weights, with its measured prior
    assert shipped.target["fingerprint"] == builtin.draft_io().fingerprint
    assert shipped.target["prior"]["lossless"]["16"] > 1.5
    rows = sp.load_model("tiny", row_end=True, **TINY)  # forced tokens inside the chain
    ar = sp.generate(rows, [1, 2], method="ar", seed=[5, 6], decode_images=False)
    out = sp.generate(rows, [1, 2], method="sjd", seed=[5, 6], window=12,
                      drafter=random_head(rows, depth=8), decode_images=False)
    assert torch.equal(out.sequence, ar.sequence)


def test_collected_stale_features_are_the_targets_with_a_rejected_draft(tiny, tiny_head):
    """The stale passes put a token other than the sample at each stale position; the first
    position of each pass (no other rejected draft before it) holds exactly the feature a
    teacher-forced forward gives one position on with that draft in place."""
    import numpy as np

    from speculaas.drafter.train import STALE_GAP, teacher_features

    data = tiny_head / "data"
    meta = json.loads((data / "data.json").read_text())
    positions = meta["stale_positions"]
    tokens = np.load(data / "tokens.npy")
    drafts, stale = np.load(data / "stale_tokens.npy"), np.load(data / "stale_features.npy")
    assert positions and (drafts != tokens[:, positions]).all()
    firsts = [i for i, p in enumerate(positions) if p < STALE_GAP]
    assert len(firsts) == 2
    for i in firsts:  # the first four images' prompts are classes 0..3
        p = positions[i]
        seq = torch.from_numpy(tokens[:4]).long()
        seq[:, p] = torch.from_numpy(drafts[:4, i]).long()
        want = teacher_features(tiny, [0, 1, 2, 3], seq, cfg=True)[:, p + 1]
        torch.testing.assert_close(torch.from_numpy(stale[:4, i]).float(), want,
                                   atol=2e-3, rtol=2e-3)  # float16 on disk


def test_a_stale_head_reads_the_feature_its_position_had_with_the_rejected_draft(tiny):
    """Whenever the loop hands a stale head a stale feature for position p, it is what the
    target computes at p with the committed tokens before p - 1 and the recorded rejected
    draft at p - 1 (a teacher-forced forward checks it), and most chains after a rejection get
    one."""
    from speculaas.drafter.train import teacher_features

    head = random_head(tiny, depth=2, stale=True)
    seen, real = [], HeadDrafter.draft

    def spy(self, memory, img, start, committed, *a, **k):
        has = memory[self.stale_pos_key][img] == start
        for i in has.nonzero().flatten().tolist():
            seen.append((int(img[i]), int(start[i]), memory[self.stale_key][img[i]].clone(),
                         int(memory[self.stale_tok_key][img[i]])))
        return real(self, memory, img, start, committed, *a, **k)

    HeadDrafter.draft = spy
    try:
        prompts = [0, 1, 2, 3]
        out = sp.generate(tiny, prompts, method="sjd", seed=[1, 2, 3, 4], window=6,
                          cfg_scale=2.0, drafter=head, decode_images=False)
    finally:
        HeadDrafter.draft = real
    assert len(seen) >= 8
    for i, p, feat, rejected in seen:
        seq = out.sequence[i : i + 1].clone()
        assert seq[0, p - 1] != rejected  # a draft that was rejected there
        seq[0, p - 1] = rejected
        want = teacher_features(tiny, [prompts[i]], seq, cfg=True)[0, p]
        torch.testing.assert_close(feat.float(), want, atol=1e-4, rtol=1e-4)


def test_llamagen_trains_a_head_and_sjd_with_it_draws_ar_tokens(tmp_path):
    """LlamaGen's sessions give a head their features: a head trained on its class prompts is
    tied to it, and sjd with it (CFG + top-k, batch 4) draws AR's tokens."""
    from conftest import assert_same_as_ar

    from speculaas.models.random_checkpoints import (
        LLAMAGEN_GRID,
        LLAMAGEN_VQ,
        write_random_checkpoint,
    )

    write_random_checkpoint("llamagen", tmp_path)
    model = sp.load_model("llamagen", str(tmp_path / "c2i_tiny_64.pt"),
                          vq=str(tmp_path / "vq_tiny.pt"), image_size=LLAMAGEN_GRID * 16,
                          vq_config=LLAMAGEN_VQ, n_head=4)
    sampling = SamplingConfig(cfg_scale=4.0, top_k=50)
    cfg = TrainConfig(images=32, batch=16, steps=10, chains=32, unroll=3, width=32, blocks=1,
                      depth=4, prior_prompts=0)
    train_drafter(model, tmp_path / "head", cfg, sampling, progress=False, log=lambda *a: None)
    head = load_head(tmp_path / "head", model)
    assert head.target["model"] == "llamagen"
    assert_same_as_ar(model, [3, 7, None, 1], windows=(4, 16, "auto"), seed=5, cfg_scale=4.0,
                      top_k=50, drafter=head)
    runs = [sp.generate(model, [3, 7, None, 1], method="sjd", window=8, seed=5, cfg_scale=4.0,
                        top_k=50, drafter=h, decode_images=False) for h in (head, None)]
    assert not torch.equal(runs[0].forward_passes, runs[1].forward_passes)  # the head drafted


def test_a_trained_head_commits_more_than_an_untrained_one(tiny, tiny_head):
    opts = dict(cfg_scale=2.0, top_k=12, decode_images=False, window=8)
    prompts, seeds = [0, 1, 2, 3] * 2, list(range(8))
    trained = sp.generate(tiny, prompts, method="sjd", seed=seeds, drafter=tiny_head, **opts)
    untrained = sp.generate(tiny, prompts, method="sjd", seed=seeds,
                            drafter=random_head(tiny, depth=3), **opts)
    assert trained.forward_passes.sum() < untrained.forward_passes.sum()


@pytest.fixture(scope="module")
def toy():
    return sp.load_model("toy", vocab_size=3, length=4, rows=2, seed=0, packed=True)


@pytest.mark.parametrize("window,cfg,tree,stale", [(4, None, None, False), (3, 2.0, None, True),
                                                   (8, None, (3, 2), False)])
def test_ratio_test_with_a_head_keeps_the_exact_law(toy, window, cfg, tree, stale):
    """The head's chain (and, in a tree, the candidates ranked by its law, walked with the
    rule on each node's output; a stale head reading the last forward's feature) keeps the
    one-sequence law exact."""
    sampling = SamplingConfig(cfg_scale=cfg)
    jacobi = JacobiConfig(window=window, verify="ratio", draft_depth=3, tree=tree)
    head = random_head(toy, depth=3, stale=stale)
    counts = sample_sequences_with(toy, jacobi, sampling, head)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) > ALPHA


@pytest.fixture
def misdeclared(monkeypatch):
    """Broken on purpose: the head draws from its law but declares that law shifted by one
    token."""
    draft = HeadDrafter.draft

    def wrong(self, *args, **kwargs):
        tokens, laws, use = draft(self, *args, **kwargs)
        return tokens, laws.roll(1, dims=-1), use

    monkeypatch.setattr(HeadDrafter, "draft", wrong)


@pytest.mark.parametrize("window,tree", [(4, None), (8, (3, 2))])
def test_a_head_declaring_another_law_fails(toy, misdeclared, window, tree):
    sampling = SamplingConfig()
    jacobi = JacobiConfig(window=window, verify="ratio", draft_depth=3, tree=tree)
    counts = sample_sequences_with(toy, jacobi, sampling, random_head(toy, depth=3))
    assert chi_square_p(counts, toy.exact_distribution(sampling)) < ALPHA


def sample_sequences_with(model, jacobi, sampling, head, n=24_000, chunk=6000):
    from collections import Counter

    counts = Counter()
    rule = sp.acceptance.get("sjd")
    for start in range(0, n, chunk):
        session = model.start([None] * chunk, cfg=sampling.uses_cfg)
        res = decode(model, session, rule, sampling, jacobi,
                     generators_for(model, start, chunk), drafter=head)
        counts.update(map(tuple, res.tokens.tolist()))
    return counts


def test_a_head_for_other_weights_is_refused(tiny, tiny_head, tmp_path):
    other = sp.load_model("tiny", **{**TINY, "seed": 1})
    with pytest.raises(ValueError, match="trained for tiny weights"):
        sp.generate(other, [0], method="sjd", drafter=tiny_head, decode_images=False)
    with pytest.raises(ValueError, match="trained for tiny weights"):
        sp.generate(other, [0], method="sjd", drafter=load_head(tiny_head, tiny),
                    decode_images=False)
    with pytest.raises(ValueError, match="'shipped' is the built-in model's"):
        sp.generate(tiny, [0], method="sjd", drafter="shipped", decode_images=False)
    with pytest.raises(ValueError, match="draft head file not found"):
        sp.generate(tiny, [0], method="sjd", drafter=tmp_path, decode_images=False)
    broken = tmp_path / "broken"
    save_head(load_head(tiny_head, tiny), broken, json.loads((tiny_head / "head.json")
                                                             .read_text()))
    data = bytearray((broken / "head.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (broken / "head.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is damaged"):
        load_head(broken, tiny)
    with pytest.raises(ValueError, match="cannot be combined with row_context"):
        sp.generate(tiny, [0], method="sjd", drafter=tiny_head, row_context=2,
                    decode_images=False)
    with pytest.raises(ValueError, match="draft_depth must be"):
        sp.generate(tiny, [0], method="sjd", drafter=tiny_head, draft_depth=0)


def test_training_resumes_to_the_same_weights(tiny, tmp_path):
    sampling = SamplingConfig(cfg_scale=2.0)
    cfg = TrainConfig(**{**vars(FAST), "prior_prompts": 0})
    whole = train_drafter(tiny, tmp_path / "whole", cfg, sampling, progress=False,
                          log=lambda *a: None)
    # Interrupted after 10 steps (its checkpoint), then run again to the end.
    part = tmp_path / "part"
    short = TrainConfig(**{**vars(cfg), "steps": cfg.steps})
    from speculaas.drafter import train as train_mod

    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def interrupt(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    torch.optim.AdamW.step = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            train_mod.train_drafter(tiny, part, short, sampling, progress=False,
                                    log=lambda *a: None)
    finally:
        torch.optim.AdamW.step = real_step
    assert (part / "train.pt").is_file() and not (part / "head.json").exists()
    train_drafter(tiny, part, short, sampling, progress=False, log=lambda *a: None)
    a = load_head(whole, tiny).state_dict()
    b = load_head(part, tiny).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method,window,options", [("sjd", "auto", {}),
                                                    ("csd", 4, {"delta": 0.8})])
def test_served_requests_with_a_head_draw_what_solo_calls_draw(tiny, tiny_head, method, window,
                                                               options):
    from speculaas.serve.engine import Engine, Request

    head = load_head(tiny_head, tiny)
    engine = Engine(tiny, max_batch=3, drafter=head)
    reqs = [Request(prompt=p, seed=s, method=method, window=window, options=options,
                    cfg_scale=2.0, top_k=12) for p, s in [(0, 5), (1, 6), (2, 7), (3, 8)]]
    futures = [engine.submit(r) for r in reqs[:2]]
    engine.run_once()
    futures += [engine.submit(r) for r in reqs[2:]]  # joining a running batch
    while engine.run_once():
        pass
    for r, f in zip(reqs, futures, strict=True):
        solo = sp.generate(tiny, [r.prompt], method=method, seed=r.seed, window=window,
                           drafter=head, cfg_scale=2.0, top_k=12, decode_images=False, **options)
        assert torch.equal(f.result().tokens, solo.tokens[0]), r
        if window != "auto":
            assert f.result().forward_passes == int(solo.forward_passes[0])


@pytest.mark.parametrize("name", ["janus", "emu3", "lumina-mgpt"])
def test_transformers_adapters_train_a_head_and_sjd_with_it_draws_ar_tokens(name, tmp_path):
    """The transformers adapters record the last hidden states: a head trained on a tiny
    checkpoint in its release's layout is tied to it, and sjd with it (the recipe's guidance)
    draws AR's tokens while the head drafts."""
    from conftest import assert_same_as_ar

    from speculaas.models.random_checkpoints import write_random_checkpoint

    ckpt = write_random_checkpoint(name, tmp_path / "ckpt")
    model = ckpt.load()
    sampling = SamplingConfig(cfg_scale=model.defaults.cfg_scale)
    cfg = TrainConfig(images=8, batch=4, steps=10, chains=8, unroll=3, width=32, blocks=1,
                      depth=4, prior_prompts=0)
    train_drafter(model, tmp_path / "head", cfg, sampling, prompts=ckpt.prompts,
                  progress=False, log=lambda *a: None)
    head = load_head(tmp_path / "head", model)
    assert head.target["model"] == model.name
    prompts = ckpt.prompts * 2
    assert_same_as_ar(model, prompts, windows=(4, "auto"), seed=5, drafter=head)
    runs = [sp.generate(model, prompts, method="sjd", window=6, seed=5,
                        drafter=h, decode_images=False) for h in (head, None)]
    assert not torch.equal(runs[0].forward_passes, runs[1].forward_passes)  # the head drafted
