"""Frozen configuration objects. The CLI and `generate()` map their options onto these."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_positive_ints, is_integer, is_number

METHODS = ("ar", "sjd", "csd", "gsd", "lantern", "amplify", "addition")
# Adapter names of models/__init__.py (listed here so the CLI's help needs no torch).
MODEL_NAMES = ("builtin", "tiny", "toy", "janus", "emu3", "lumina-mgpt", "chameleon", "anole",
               "llamagen")
# Names of the drafters in decoding/drafting.py (checked against its registries in the tests).
DRAFT_INITS = ("uniform", "onehot", "vertical", "vertical_sample")
COUPLINGS = ("none", "maximal", "gumbel")
# The best measured drafting on the built-in model, for lossless and relaxed rules alike
# (docs/benchmarks.md, "Drafting"): coupled tails, fresh slots copied from the row above.
DEFAULT_DRAFT_INIT = "vertical"
DEFAULT_COUPLING = "maximal"
ADVANCE_MODES = ("per_image", "batch_min")
VERIFY_MODES = ("gumbel", "ratio")
# Beyond these, logits / temperature or guided logits overflow float32 into NaN probabilities.
TEMPERATURE_RANGE = (1e-2, 1e2)
CFG_RANGE = (0.0, 100.0)
# Each relaxed rule's options and defaults (acceptance/*.py; checked against the rule classes
# in the tests), so that the CLI's help shows them without importing torch.
RULE_DEFAULTS = {
    "csd": {"lam": 0.5, "delta": 0.65, "filter": "tv"},
    "gsd": {"group_size": 15, "prob_threshold": 0.15, "dist_threshold": 0.5},
    "lantern": {"k": 100, "delta": 0.1},
    "amplify": {"k": 1.3},
    "addition": {"eps": 0.1},
}
MAX_WINDOW = 256
DEFAULT_WINDOW = "auto"  # raster order: the compute-aware window
ROW_WINDOW = 16  # each row of the two-dimensional window



@dataclass(frozen=True)
class SamplingConfig:
    """How logits become the target distribution. Applied once, before any acceptance rule.

    cfg_scale: classifier-free guidance `uncond + cfg_scale * (cond - uncond)` on logits; None or
        1 disables the unconditional branch.
    temperature: > 0. top_k: keep the k largest logits (None: all). top_p: nucleus mass in (0, 1].
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    cfg_scale: float | None = None

    def __post_init__(self) -> None:
        lo, hi = TEMPERATURE_RANGE
        if not (is_number(self.temperature) and lo <= self.temperature <= hi):
            raise ValueError(f"temperature must be a number in [{lo}, {hi}], got "
                             f"{self.temperature!r} (for greedy decoding use top_k=1)")
        if self.top_k is not None and not (is_integer(self.top_k) and self.top_k >= 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        lo, hi = CFG_RANGE
        if self.cfg_scale is not None and not (is_number(self.cfg_scale)
                                               and lo <= self.cfg_scale <= hi):
            raise ValueError(f"cfg_scale must be a number in [{lo}, {hi}] or None, got "
                             f"{self.cfg_scale!r}")

    @property
    def uses_cfg(self) -> bool:
        return self.cfg_scale is not None and self.cfg_scale != 1.0


# Most off-chain tree nodes one forward may hold per image (models/base.SCRATCH_SLOTS).
MAX_TREE_NODES = 128


def tree_nodes(k: int, d: int) -> int:
    """Nodes of a full K-ary tree of depth D below its root (its chain of D included)."""
    return sum(k**i for i in range(1, d + 1))


def parse_tree(tree: object) -> tuple[int, int, int | None]:
    """(K, D) or (K, D, N) as a tuple, a list, "K,D[,N]" or "KxD[xN]": K >= 2 candidates at each
    of up to D >= 1 positions, N >= 1 off-chain nodes (None: the full tree, at most half the
    window; decoding/tree.py) -> (K, D, N)."""
    text = tree
    if isinstance(tree, str):
        parts = tree.lower().replace("x", ",").split(",")
        try:
            tree = tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"tree must be K,D or K,D,N (or KxD, KxDxN), e.g. 4,6; got "
                             f"{text!r}") from None
    if (not isinstance(tree, (tuple, list)) or len(tree) not in (2, 3)
            or not all(v is None or is_integer(v) for v in tree)
            or any(v is None for v in tree[:2])):
        raise ValueError("tree must be (K, D) or (K, D, N): K candidates at each of up to D "
                         f"positions, N off-chain nodes; got {text!r}")
    k, d = int(tree[0]), int(tree[1])
    n = None if len(tree) == 2 or tree[2] is None else int(tree[2])
    if k < 2 or d < 1:
        raise ValueError(f"tree needs K >= 2 candidates and depth D >= 1, got K={k}, D={d}")
    if n is not None and not 1 <= n <= MAX_TREE_NODES:
        raise ValueError(f"tree needs 1 <= N <= {MAX_TREE_NODES} off-chain nodes, got N={n}")
    return k, d, n


@dataclass(frozen=True)
class JacobiConfig:
    """The speculative Jacobi loop.

    window: W input slots per forward (the last committed token + W - 1 drafts), so at most W
        tokens are committed per target forward. W = 1 is plain autoregressive decoding.
        "auto": chosen every iteration from the measured cost of an iteration on this machine
        and batch, a measured prior of what each window commits and the images' acceptance so
        far (decoding/window.py), up to 64; plain AR where no window pays. None (the default):
        "auto" in raster order, ROW_WINDOW with row_context (each row needs a fixed window).
    draft_init: what fresh draft slots hold: "uniform" (a uniform random token whose draft
        distribution is uniform, as CSD does), "onehot" (the same token, declared one-hot at
        itself, as SJD's code does; accepted less often), "vertical" (the token one row above,
        declared one-hot), "vertical_sample" (a sample from the target distribution stored for
        the slot above, declared as that distribution).
    coupling: how tail slots after the first rejection become the next drafts: "none"
        (independent redraw from the new target, SJD), "maximal" (keep the old draft with
        probability min(1, target/draft), else draw from the residual), "gumbel" (argmax of
        log target + Gumbel noise fixed per image and position). All exact for every rule.
    verify: how exact rules (sjd, and any rule at zero relaxation) test drafts. "gumbel" (the
        default): every image has Gumbel noise g fixed per position and token by its seed, the
        token of a position is argmax(log target + g) exactly as plain AR decoding samples it,
        a draft is accepted when it equals that argmax, the argmax is committed at the first
        mismatch, and tail and fresh slots are redrafted as argmax(log law + g) of their draft
        law; so sjd draws the very tokens ar draws for the same seed, at any window, batch or
        drafting (coupling is then moot: the tail is always the Gumbel argmax). "ratio": the
        classic min(1, target/draft) test with the uniforms of the image's stream; exact in
        distribution only. Relaxed rules always use their own ratio test.
    advance: "per_image" (each image commits its own accepted prefix) or "batch_min" (every image
        advances by the batch's smallest accepted length, as the reference code does; biased and
        slower, kept for comparison).
    row_context: None (raster order) or c >= 1: the two-dimensional window
        (decoding/frontier_rows.py);
        row r + 1 starts drafting once row r has c committed tokens, each active row with a
        window of its own behind the row above. Not lossless for any rule; c = a full row is
        one-dimensional Jacobi decoding.
    tree: None (a chain) or (K, D) or (K, D, N): a candidate tree at the head of every raster
        window, K candidates at each of up to D positions, N off-chain nodes (None: the full
        K-ary tree, pruned to half the window); decoding/tree.py. `window` is then the width
        budget, the tree's slots included. Keeps each rule's law (sjd stays identical to ar for
        the same seed).
    """

    window: int | str | None = None
    draft_init: str = DEFAULT_DRAFT_INIT
    coupling: str = DEFAULT_COUPLING
    advance: str = "per_image"
    row_context: int | None = None
    verify: str = "gumbel"
    tree: tuple[int, int, int | None] | None = None
    draft_depth: int | None = None
    head_blend: float | None = None

    def __post_init__(self) -> None:
        if self.draft_depth is not None and not (is_integer(self.draft_depth)
                                                 and 1 <= self.draft_depth <= 64):
            raise ValueError(f"draft_depth must be an integer in 1..64, got {self.draft_depth!r}")
        if self.head_blend is not None and not (is_number(self.head_blend)
                                                and 0 <= self.head_blend <= 8):
            raise ValueError(f"head_blend must be a number in [0, 8], got {self.head_blend!r}")
        if self.tree is not None:
            object.__setattr__(self, "tree", parse_tree(self.tree))
            if self.row_context is not None:
                raise ValueError("tree and row_context cannot be combined: trees grow at the "
                                 "head of a raster window")
            if self.advance != "per_image":
                raise ValueError("a tree needs advance='per_image'")
        if self.window is None:
            object.__setattr__(self, "window",
                               DEFAULT_WINDOW if self.row_context is None else ROW_WINDOW)
        if self.window != "auto" and not (is_integer(self.window)
                                          and 1 <= self.window <= MAX_WINDOW):
            raise ValueError(f"window must be an integer in [1, {MAX_WINDOW}] or 'auto', got "
                             f"{self.window!r}")
        if self.draft_init not in DRAFT_INITS:
            raise ValueError(f"unknown draft_init {self.draft_init!r}; valid: {DRAFT_INITS}")
        if self.coupling not in COUPLINGS:
            raise ValueError(f"unknown coupling {self.coupling!r}; valid: {COUPLINGS}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"unknown verify {self.verify!r}; valid: {VERIFY_MODES}")
        if self.advance not in ADVANCE_MODES:
            raise ValueError(f"unknown advance {self.advance!r}; valid: {ADVANCE_MODES}")
        if self.row_context is not None and not (is_integer(self.row_context)
                                                 and self.row_context >= 1):
            raise ValueError("row_context must be an integer >= 1 (tokens of the row above "
                             f"committed before a row starts) or None, got {self.row_context!r}")


@dataclass(frozen=True)
class TrainConfig:
    """images: target samples to distil from; batch: images per AR decode while collecting;
    steps / chains / lr: optimisation (chains: minibatch of chains per step); unroll: chain
    steps trained per chain; width / blocks / depth / stale: the head (HeadConfig; stale: its
    first step reads the stale feature, recorded by teacher-forced passes with rejected drafts);
    holdout: share of the images kept out of training to report agreement; prior_prompts:
    held-out prompts decoded per window for the auto window's prior (0: none);
    checkpoint_every: steps."""

    images: int = 1536
    batch: int = 32
    steps: int = 2000
    chains: int = 192
    lr: float = 2e-3
    unroll: int = 8
    width: int = 256
    blocks: int = 2
    depth: int = 1
    stale: bool = False
    holdout: float = 0.05
    seed: int = 0
    prior_prompts: int = 8
    checkpoint_every: int = 200

    def __post_init__(self) -> None:
        check_positive_ints(self, ("images", "batch", "steps", "chains", "unroll", "width",
                                   "blocks", "depth", "checkpoint_every"))
        if not isinstance(self.stale, bool):
            raise ValueError(f"stale must be true or false, got {self.stale!r}")
        if not (isinstance(self.prior_prompts, int) and self.prior_prompts >= 0):
            raise ValueError(f"prior_prompts must be an integer >= 0, got {self.prior_prompts!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")
        if not (isinstance(self.holdout, (int, float)) and 0 <= self.holdout < 0.5):
            raise ValueError(f"holdout must be in [0, 0.5), got {self.holdout!r}")
        if self.depth > 64 or self.unroll > 64:
            raise ValueError("depth and unroll are at most 64")
