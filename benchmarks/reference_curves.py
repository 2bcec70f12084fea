"""The CPU reference cost curves (decoding/costs.py REFERENCE_CURVES): one iteration of the
built-in model's loop at each window, in units of one plain AR step of the same batch, for sjd
and csd at batch sizes 1, 2, 4 and 8 (measured up front, as the server's warm-up does).

    SPECULAAS_CACHE_DIR=off python benchmarks/reference_curves.py   # on a quiet machine

Prints one line per rule and batch; the package ships the csd lines (the curve relaxed rules
decide with, and sample-exact ones start from before they learn their own).
"""

import json

import speculaas as sp
from speculaas.api import build_rule, resolve_sampling
from speculaas.config import JacobiConfig
from speculaas.decoding.loop import measure_cost_curve

WINDOWS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)


def main() -> None:
    model = sp.load_model("builtin")
    sampling = resolve_sampling(model, None, None, None, None)
    out = {}
    for method in ("sjd", "csd"):
        rule = build_rule(model, method)
        for batch in (1, 2, 4, 8):
            session = model.start(["a big red circle on the left over grass"] * batch,
                                  cfg=sampling.uses_cfg)
            curve = measure_cost_curve(model, session, sampling, WINDOWS, rule,
                                       JacobiConfig(window=max(WINDOWS)))
            out[f"{method}/{batch}"] = {w: round(t / curve[0], 3) for w, t in curve.items()}
            print(method, batch, out[f"{method}/{batch}"], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
