"""The window policy: `window="auto"` keeps lossless rules lossless, varies the window with what
it observes, and follows the cost curve it is given."""

import itertools
import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from test_statistical import ALPHA, N_SAMPLES, chi_square_p

import speculaas as sp
from speculaas.api import generators_for
from speculaas.config import JacobiConfig, SamplingConfig
from speculaas.decoding import decode
from speculaas.decoding import loop as loop_mod
from speculaas.decoding.loop import measure_cost_curve
from speculaas.decoding.window import AutoWindow

# A cost curve and prior under which the best window depends on the acceptance seen so far.
CURVE = {1: 1.0, 2: 1.25, 3: 1.6, 4: 2.2}
CFG = SamplingConfig(cfg_scale=2.0)
PRIOR = {1: 1.0, 4: 2.5}


@pytest.mark.parametrize("coupling", ["none", "maximal"])
def test_auto_window_is_lossless(coupling):
    toy = sp.load_model("toy", vocab_size=3, length=4, seed=0)
    sampling = SamplingConfig()
    counts, windows = Counter(), []
    for start in range(0, N_SAMPLES, 6000):
        policy = AutoWindow(max_window=4, candidates=(1, 2, 3, 4), cost=CURVE, prior=PRIOR,
                            strength=2.0, stickiness=1.0, margin=1.0)  # quick to react
        res = decode(toy, toy.start([None] * 6000, cfg=False), sp.acceptance.get("sjd"),
                            sampling, JacobiConfig(window=4, coupling=coupling),
                            generators_for(toy, start, 6000), policy=policy)
        counts.update(map(tuple, res.tokens.tolist()))
        windows.append(res.mean_window)
    assert chi_square_p(counts, toy.exact_distribution(sampling)) > ALPHA
    mean_window = torch.cat(windows)
    assert mean_window.min() < mean_window.max()  # the choice really varied


def test_auto_window_follows_the_cost_curve(tiny):
    flat = {w: 1.0 for w in (1, 2, 4, 8, 16)}  # long windows cost nothing extra: use them
    steep = {w: float(w) for w in (1, 2, 4, 8, 16)}  # cost grows with W: never worth it
    outs = {}
    for name, curve in (("flat", flat), ("steep", steep)):
        policy = AutoWindow(max_window=16, candidates=tuple(curve), cost=curve)
        outs[name] = sp.generate(tiny, [1, 2], method="sjd", window=policy, seed=0,
                                 decode_images=False)
    assert (outs["flat"].mean_window > 12).all()  # ties at tiny acceptance may pick less
    # Steep: no window can pay even under the prior, so the decode is plain AR.
    assert (outs["steep"].mean_window == 1).all()
    ar = sp.generate(tiny, [1, 2], method="ar", seed=0, decode_images=False)
    assert torch.equal(outs["steep"].forward_passes, ar.forward_passes)
    assert torch.equal(outs["steep"].tokens, ar.tokens)
    assert outs["steep"].accept_hist.shape == (2, 16)


def test_auto_window_greedy_equals_ar(tiny):
    ar = sp.generate(tiny, [3, None], method="ar", top_k=1, cfg_scale=2.0)
    out = sp.generate(tiny, [3, None], method="csd", top_k=1, cfg_scale=2.0, window="auto",
                      coupling="maximal")
    assert torch.equal(out.tokens, ar.tokens)
    assert out.mean_window.shape == (2,) and (out.mean_window >= 1).all()


def test_cost_curve_is_measured_once_and_positive(tiny):
    session = tiny.start([1], cfg=True)
    curve = measure_cost_curve(tiny, session, CFG, (1, 4))
    assert set(curve) == {1, 4} and all(t > 0 for t in curve.values())
    assert measure_cost_curve(tiny, session, CFG, (1, 4)) == curve  # cached


@pytest.mark.parametrize("bad", [0, -3, 16.0, True, "big", "None"])
def test_bad_windows_are_refused(tiny, bad):
    with pytest.raises(ValueError, match="window"):
        sp.generate(tiny, [1], method="sjd", window=bad)


def test_auto_window_is_reproducible_within_a_process(tiny):
    a = sp.generate(tiny, [1, 2], method="csd", window="auto", seed=4, decode_images=False)
    b = sp.generate(tiny, [1, 2], method="csd", window="auto", seed=4, decode_images=False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mean_window, b.mean_window)


def test_auto_window_shortens_for_rejecting_images_and_retries(tiny):
    policy = AutoWindow(max_window=16, candidates=(1, 4, 16), cost={1: 1.0, 4: 1.6, 16: 3.0},
                        prior={1: 1.0, 4: 1.8, 16: 3.6}, stickiness=1.0, strength=4.0,
                        decay=0.9)
    policy.begin(tiny, tiny.start([1, 2], cfg=False), cfg=False)
    act, both = torch.tensor([0]), torch.tensor([True, True])
    only0, only1 = torch.tensor([True, False]), torch.tensor([False, True])
    assert policy.choose(only0).item() == 16  # at the prior: 3.6 / 3.0 beats 1.8 / 1.6 and 1
    for _ in range(10):  # image 0 keeps rejecting its first draft
        policy.observe(act, torch.tensor([16]), torch.tensor([16]), torch.tensor([0]))
    assert policy.choose(only0).item() == 1
    assert policy.choose(only1).item() == 16  # image 1 has its own record
    # Both together: one window for the batch, the one that serves the two best in sum
    # (image 0 expects 1.49 tokens at W = 16, image 1 3.6: (1.49 + 3.6) / 3.0 < 2 / 1.0).
    assert policy.choose(both).item() == 1
    for _ in range(40):  # a single-token iteration verifies nothing: back towards the prior
        policy.observe(act, torch.tensor([1]), torch.tensor([1]), torch.tensor([0]))
    assert policy.choose(only0).item() == 16
    for _ in range(10):  # runs of accepted drafts well above the prior keep the long window
        policy.observe(act, torch.tensor([16]), torch.tensor([16]), torch.tensor([12]))
    assert policy.content(act).item() > 2 and policy.choose(only0).item() == 16


def test_default_window_is_auto_in_raster_order_and_16_for_rows(tiny):
    from speculaas.config import JacobiConfig

    assert JacobiConfig().window == "auto"
    assert JacobiConfig(row_context=2).window == 16
    out = sp.generate(tiny, [1], method="sjd", row_context=2, decode_images=False)
    assert out.mean_window.tolist() == [16.0]


def test_cost_curve_persists_for_the_machine(tmp_path, monkeypatch):
    from speculaas.decoding.costs import cost_cache_file

    monkeypatch.setenv("SPECULAAS_CACHE_DIR", str(tmp_path))
    # A steady clock (each reading dt later than the last): on a busy machine real timings can
    # stay noisy for every round, and a noisy curve is rightly measured again by the next
    # process. dt changes after the first measurement, so measuring again would show.
    clock = {"now": 0.0, "dt": 5e-4}

    def tick() -> float:
        clock["now"] += clock["dt"]
        return clock["now"]

    monkeypatch.setattr(loop_mod, "time", SimpleNamespace(perf_counter=tick))
    first = sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0)
    curve = measure_cost_curve(first, first.start([1], cfg=True), CFG, (1, 4))
    clock["dt"] = 1e-3
    assert cost_cache_file() == tmp_path / "cost_curves.json" and cost_cache_file().is_file()
    # Another model object of the same shape (another process, in effect) reuses the curve.
    second = sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=1)
    assert measure_cost_curve(second, second.start([1], cfg=True), CFG, (1, 4)) == curve
    # A different batch is another measurement; "off" keeps curves in memory only.
    monkeypatch.setenv("SPECULAAS_CACHE_DIR", "off")
    assert cost_cache_file() is None
    third = sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=2)
    measure_cost_curve(third, third.start([1, 2], cfg=True), CFG, (1, 4))
    assert len(json.loads((tmp_path / "cost_curves.json").read_text())) == 1


# The cost-curve cache as a user relies on it. ----------------------------------------------


def steady(windows):  # a consistent measurement: cost grows with the window, timings agree
    return {w: [0.01 * (1 + w)] * 4 for w in windows}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULAAS_CACHE_DIR", str(tmp_path))
    return tmp_path / "cost_curves.json"


def fresh_tiny():  # another model object of one shape: another process, as far as caching goes
    return sp.load_model("tiny", vocab_size=12, grid=(3, 5), seed=0)


class Counting:
    def __init__(self, fn=steady):
        self.fn, self.calls = fn, []

    def __call__(self, windows):
        self.calls.append(tuple(windows))
        return self.fn(windows)


@pytest.mark.parametrize("text", ["[]", "NaN", "{not json", '"a string"', "null"])
def test_a_cache_file_of_the_wrong_shape_is_ignored_once(cache, text):
    from speculaas.decoding.costs import cost_curve

    cache.write_text(text)
    measure = Counting()
    with pytest.warns(UserWarning, match="cost-curve cache"):
        curve = cost_curve(fresh_tiny(), 1, False, "t", (0, 1, 4), measure)
    assert curve == {0: 0.01, 1: 0.02, 4: 0.05} and measure.calls == [(0, 1, 4)]
    assert isinstance(json.loads(cache.read_text()), dict)  # rewritten whole


@pytest.mark.parametrize("entry", [{"t": {"1": 0.0, "4": 0.1}, "ok": True},
                                   {"t": {"1": -1.0, "4": 0.1}, "ok": True},
                                   {"t": {"1": "NaN", "4": 0.1}, "ok": True},
                                   {"t": [], "ok": True}, {"1": 0.5, "4": 0.9}, []])
def test_stored_curves_with_bad_times_are_measured_again(cache, entry):
    from speculaas.decoding.costs import _curve_key, cost_curve

    model = fresh_tiny()
    cache.write_text(json.dumps({_curve_key(model, 1, False, "t"): entry}))
    measure = Counting()
    with pytest.warns(UserWarning, match="malformed"):
        assert cost_curve(model, 1, False, "t", (1, 4), measure) == {1: 0.02, 4: 0.05}
    assert measure.calls == [(1, 4)]


def test_measuring_a_new_window_keeps_the_stored_ones(cache):
    from speculaas.decoding.costs import cost_curve

    cost_curve(fresh_tiny(), 1, False, "t", (1, 4), Counting())
    cost_curve(fresh_tiny(), 2, False, "t", (1,), Counting())  # another batch: another entry
    later = Counting(lambda ws: {w: [9.0] * 4 for w in ws})
    assert cost_curve(fresh_tiny(), 1, False, "t", (1, 4, 8), later) == {1: 0.02, 4: 0.05,
                                                                          8: 9.0}
    assert later.calls == [(8,)]
    table = json.loads(cache.read_text())
    batch1 = [v for k, v in table.items() if json.loads(k)[9] == 1]
    assert len(table) == 2 and sorted(batch1[0]["t"]) == ["1", "4", "8"]


def test_a_curve_measured_on_a_busy_machine_is_provisional(cache):
    from speculaas.decoding import costs as window

    def busy(ws):  # timings that disagree by a factor of 10: someone else had the CPU
        return {w: [0.01, 0.1, 0.01, 0.1] for w in ws}

    measure = Counting(busy)
    window.cost_curve(fresh_tiny(), 1, False, "t", (1, 4), measure)
    assert len(measure.calls) == 1 + window.RETRIES  # measured again within the process
    stored = next(iter(json.loads(cache.read_text()).values()))
    assert stored["ok"] is False and stored["spread"]["1"] > window.MAX_SPREAD
    # The next process measures it again and keeps the steadier curve ...
    calm = Counting()
    assert window.cost_curve(fresh_tiny(), 1, False, "t", (1, 4), calm) == {1: 0.02, 4: 0.05}
    assert calm.calls == [(1, 4)]
    stored = next(iter(json.loads(cache.read_text()).values()))
    assert stored["ok"] is True and stored["rounds"] == 2
    # ... which then stays.
    assert window.cost_curve(fresh_tiny(), 1, False, "t", (1, 4), Counting(busy)) == {
        1: 0.02, 4: 0.05}
    # A machine that is always busy is re-measured at most ROUNDS times in all.
    cache.unlink()
    for _ in range(window.ROUNDS + 2):
        window.cost_curve(fresh_tiny(), 1, False, "u", (1,), Counting(busy))
    assert next(iter(json.loads(cache.read_text()).values()))["rounds"] == window.ROUNDS


def test_inconsistent_curves_are_caught():
    from speculaas.decoding.costs import consistent

    assert consistent({0: 1.0, 1: 1.1, 4: 2.0}, {0: 0.1, 1: 0.1, 4: 0.1})
    assert not consistent({0: 1.0, 1: 1.1, 4: 0.5}, {0: 0.1, 1: 0.1, 4: 0.1})  # W=4 cheaper
    assert not consistent({1: 1.0, 4: 2.0}, {1: 0.9, 4: 0.1})  # spread
    assert not consistent({1: float("nan"), 4: 2.0}, {1: 0.1, 4: 0.1})


def test_the_key_holds_sampling_work_and_prompt_length(cache):
    model = fresh_tiny()
    for sampling in (CFG, SamplingConfig(cfg_scale=2.0, top_k=3),
                     SamplingConfig(cfg_scale=2.0, top_p=0.9)):
        measure_cost_curve(model, model.start([1], cfg=True), sampling, (1,), sweeps=1,
                           warm=0, timed=2)
    assert len(json.loads(cache.read_text())) == 3


class NoisyClock:
    """A timer made slow and noisy (each reading advances by a random 0.1 - 50 s, as on a
    machine whose neighbours come and go), counting its readings."""

    def __init__(self, seed):
        self.g, self.now, self.calls = torch.Generator().manual_seed(seed), 0.0, 0

    def __call__(self):
        self.calls += 1
        self.now += float(10 ** (torch.rand((), generator=self.g) * 2.7 - 1))
        return self.now


def test_auto_times_nothing_before_the_first_token(cache, capsys):
    clock = NoisyClock(0)
    out = sp.generate(fresh_tiny(), [1, 2], method="sjd", seed=0, decode_images=False,
                      window=AutoWindow(clock=clock))
    # The clock is read once per iteration, right after the loop's own synchronisation:
    # nothing else is timed, before the first token or after it.
    assert clock.calls == int(out.forward_passes.max())
    assert "timing" not in capsys.readouterr().err


def test_exact_rules_draw_ar_tokens_under_any_curve_the_online_estimate_reaches(tiny):
    ar = sp.generate(tiny, [1, 2, None], method="ar", seed=3, decode_images=False)
    windows = set()
    for seed in range(6):
        policy = AutoWindow(max_window=16, clock=NoisyClock(seed), refresh=1)
        out = sp.generate(tiny, [1, 2, None], method="sjd", seed=3, decode_images=False,
                          window=policy)
        assert torch.equal(out.tokens, ar.tokens)
        windows.add(tuple(sorted(out.windows[0].items())))
    assert len(windows) > 1  # the noisy timings really moved the windows


def test_relaxed_rules_draw_the_same_picture_however_busy_the_machine(cache):
    model = fresh_tiny()
    first = sp.generate(model, [1, 2], method="csd", seed=5, decode_images=False,
                        window=AutoWindow(clock=NoisyClock(1)))
    # This machine's stored curve (any shape) and its clock do not reach a relaxed decode.
    sp.generate(model, [1, 2], method="sjd", seed=5, decode_images=False,
                window=AutoWindow(clock=NoisyClock(2)))
    again = sp.generate(fresh_tiny(), [1, 2], method="csd", seed=5, decode_images=False,
                        window=AutoWindow(clock=NoisyClock(3)))
    assert torch.equal(first.tokens, again.tokens) and first.windows == again.windows
    ratio = sp.generate(model, [1, 2], method="sjd", verify="ratio", seed=5,
                        decode_images=False, window=AutoWindow(clock=NoisyClock(4)))
    assert ratio.windows == sp.generate(model, [1, 2], method="sjd", verify="ratio", seed=5,
                                        decode_images=False).windows


def test_what_a_decode_learns_is_stored_and_started_from(cache):
    from speculaas.decoding.costs import CurveSource

    ticks = itertools.count()  # every iteration takes one second, whatever its window
    sp.generate(fresh_tiny(), [1], method="sjd", seed=0, decode_images=False,
                window=AutoWindow(max_window=16, clock=lambda: float(next(ticks))))
    [(key, entry)] = json.loads(cache.read_text()).items()
    timed = {int(w) for w in entry["spread"]}
    assert timed and all(entry["t"][str(w)] == 1.0 for w in timed)
    # A new process (another model object) starts from it and trusts the timed windows.
    batch, cfg, tag = json.loads(key)[-4:-1]
    online = CurveSource(fresh_tiny(), batch, cfg, tag, learn=True).open()
    assert all(online.known(w) for w in timed)
    assert online.curve(sorted(timed)) == {w: 1.0 for w in sorted(timed)}


def test_the_online_curve_is_robust_and_carries_its_scale_to_untimed_windows():
    from speculaas.decoding.costs import OnlineCurve

    online = OnlineCurve({0: 1.0, 4: 2.0, 16: 4.0})  # a reference, in AR steps
    for t in (0.02, 0.02, 9.0, 0.02, 0.021):  # one iteration slowed by a neighbour's burst
        online.add(4, t)
    online.add(16, float("nan"))  # never a sample
    curve = online.curve((0, 4, 8, 16))
    assert curve[4] == 0.02 and not online.known(16)
    assert curve[0] == pytest.approx(0.01) and curve[16] == pytest.approx(0.04)
    assert curve[8] == pytest.approx(0.01 * (2 + 2 * 4 / 12))  # between 4 and 16
