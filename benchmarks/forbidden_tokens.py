"""What never committing a token the target forbids costs in forwards: relaxed rules on a
row-end layout (tiny model, default drafting; counting forbidden tokens committed), and csd on
the built-in model with and without top-k.

    SPECULAAS_CACHE_DIR=off python benchmarks/forbidden_tokens.py
    PYTHONPATH=OTHER_CHECKOUT/src python benchmarks/forbidden_tokens.py   # the other side

Numbers: docs/forbidden_tokens.log.
"""

import speculaas as sp

CAPTIONS = ["a big red circle on the left over grass",
            "a small blue square on the right at sunset",
            "a big green triangle on the center under a blue sky",
            "a small white diamond on the left in front of a brick wall"] * 4


def main() -> None:
    tiny = sp.load_model("tiny", vocab_size=6, grid=(3, 4), seed=1, row_end=True)
    for method, opts in [("csd", {}), ("addition", {"eps": 0.3}), ("gsd", {})]:
        out = sp.generate(tiny, [3] * 400, method=method, window=8, seed=0,
                          decode_images=False, **opts)
        print(f"tiny row_end {method}: fwd/image {out.forward_passes.float().mean():.2f}, "
              f"forbidden tokens {int((out.tokens >= 6).sum())}")
    builtin = sp.load_model("builtin")
    for top_k in (None, 50):
        out = sp.generate(builtin, CAPTIONS, method="csd", window=16, top_k=top_k, seed=0,
                          decode_images=False, delta=0.65)
        print(f"builtin csd(0.65) W16 top_k={top_k}: fwd/image "
              f"{out.forward_passes.float().mean():.2f}")


if __name__ == "__main__":
    main()
