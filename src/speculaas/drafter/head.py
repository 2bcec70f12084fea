"""A trained draft head: a small network over the target's own features that guesses the next
tokens of a window, and the files that tie it to the one target it was trained for.

One step reads the target's feature that decided position p - 1 (the output head's input at
that slot, or the head's own output one step earlier), the embedding of the token at p - 1 and
of the token one row above p, and the position p; it returns a feature in the target's space,
which the target's own output head turns into logits (EAGLE shares its target's embedding and
output head in the same way). Run for a few steps it drafts a chain; with guidance it runs on
the conditional and the unconditional features and its logits are mixed as the target's are.

A head with `stale` also reads, at its first step, the stale feature of position p: what the
target's last forward computed there with another token (the rejected draft) at p - 1, and that
token's embedding. The stale feature has seen the whole image through every layer; the head
learns how changing the last input token moves it, which the product with the stale law alone
cannot (a learned vector stands in where no stale feature exists).

Files: `head.safetensors` (the weights) and `head.json` (the configuration, the target's name
and weights fingerprint, the sampling it was trained under, the weights' sha256).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..checks import check_positive_ints
from ..models.base import ImageModel

WEIGHTS, RECORD, FORMAT = "head.safetensors", "head.json", "speculaas-draft-head/1"


@dataclass(frozen=True)
class HeadConfig:
    """dim: the target's feature width; width / blocks: the head's own; length: generated
    positions; stride: positions per image row (a row end included); vocab: the target's;
    depth: chain steps drafted per window (an option at use, this is its default); stale:
    the first step also reads the stale feature of its position (module docstring)."""

    dim: int
    width: int
    blocks: int
    length: int
    stride: int
    vocab: int
    depth: int = 4
    stale: bool = False

    def __post_init__(self) -> None:
        check_positive_ints(self, [k for k in asdict(self) if k != "stale"], "head config ")
        if not isinstance(self.stale, bool):
            raise ValueError(f"head config stale must be true or false, got {self.stale!r}")


class DraftHead(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.inp = nn.Linear((5 if cfg.stale else 3) * cfg.dim, w)
        self.pos = nn.Embedding(cfg.length + 1, w)
        self.no_above = nn.Parameter(torch.zeros(cfg.dim))  # first row: nothing above
        if cfg.stale:  # no stale feature (a chain's later steps, a fully accepted window)
            self.no_stale = nn.Parameter(torch.zeros(2, cfg.dim))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(w), nn.Linear(w, 2 * w), nn.GELU(), nn.Linear(2 * w, w))
            for _ in range(cfg.blocks))
        self.out = nn.Sequential(nn.LayerNorm(w), nn.Linear(w, cfg.dim))
        self.target: dict = {}  # what head.json says about the target (set by load / train)

    def forward(self, feature: torch.Tensor, left: torch.Tensor, above: torch.Tensor,
                has_above: torch.Tensor, pos: torch.Tensor,
                stale: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor:
        """feature [..., dim]: what decided position pos - 1; left, above [..., dim]: embeddings
        of the tokens at pos - 1 and pos - stride (has_above [...] False: none); pos [...];
        stale (a `stale` head): (the stale feature of pos [..., dim], the embedding of the token
        it had at pos - 1 [..., dim], which exist [...]), or None where none does
        -> the feature that decides position pos, [..., dim]."""
        above = torch.where(has_above[..., None], above, self.no_above.to(above.dtype))
        parts, base = [feature, left, above], None
        if self.cfg.stale:
            none = self.no_stale.to(feature.dtype)
            if stale is None:
                parts += [none[0].expand_as(feature), none[1].expand_as(feature)]
            else:
                feat, tok, has = stale
                parts += [torch.where(has[..., None], feat, none[0]),
                          torch.where(has[..., None], tok, none[1])]
                base = torch.where(has[..., None], feat, 0.0)  # a correction of the stale one
        x = self.inp(torch.cat(parts, -1)) + self.pos(pos)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x) if base is None else base + self.out(x)

    @property
    def head_id(self) -> str:
        """Names these weights in cost-curve tags and benchmark records."""
        return self.target.get("weights_sha256", "untrained")[:12]


def save_head(head: DraftHead, folder: str | Path, target: dict) -> Path:
    """Write head.safetensors and head.json into `folder`; target: the target's name,
    fingerprint and the training record (sampling, data, steps)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / WEIGHTS
    state = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()}
    tmp = weights.with_suffix(".tmp")
    save_file(state, str(tmp))
    tmp.replace(weights)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    record = {"format": FORMAT, "config": asdict(head.cfg), **target, "weights_sha256": digest}
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    head.target = record
    return folder


def shipped_head_path() -> Path:
    """The head shipped for the built-in model (`speculaas train-drafter --model builtin`, its
    defaults; docs/benchmarks.md, "Trained draft heads")."""
    from ..models.builtin.model import WEIGHTS_DIR

    return WEIGHTS_DIR / "drafter"


def load_head(path: str | Path, model: ImageModel) -> DraftHead:
    """A head from its folder (or "shipped": the built-in model's), refused with a one-line
    reason when a file is missing or damaged or when it was trained for another target."""
    if str(path) == "shipped":
        if model.name != "builtin":
            raise ValueError(f"drafter 'shipped' is the built-in model's head; model "
                             f"{model.name!r} needs a head of its own (speculaas train-drafter)")
        path = shipped_head_path()
    folder = Path(path)
    weights, record_path = folder / WEIGHTS, folder / RECORD
    for f in (weights, record_path):
        if not f.is_file():
            raise ValueError(f"draft head file not found: {f} (a head folder holds {WEIGHTS} "
                             f"and {RECORD}; `speculaas train-drafter --out DIR` makes them)")
    try:
        record = json.loads(record_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{record_path} is not valid JSON: {e}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{record_path} is not a draft head record (format {FORMAT})")
    io = model.draft_io()
    if io is None:
        raise ValueError(f"model {model.name!r} does not give a draft head its features "
                         "(drafters run on builtin and tiny)")
    want = (record.get("model"), record.get("fingerprint"))
    if want != (model.name, io.fingerprint):
        raise ValueError(f"draft head {folder} was trained for {want[0]} weights {want[1]}, not "
                         f"for this {model.name} ({io.fingerprint}); train one for it with "
                         "speculaas train-drafter")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != record.get("weights_sha256"):
        raise ValueError(f"{weights} is damaged: its sha256 {digest[:16]}... is not the one "
                         f"recorded in {record_path}")
    try:
        cfg = HeadConfig(**record["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{record_path}: bad head configuration: {e}") from None
    if (cfg.dim, cfg.vocab, cfg.length) != (io.dim, model.vocab_size, model.layout.length):
        raise ValueError(f"draft head {folder} has dim {cfg.dim}, vocabulary {cfg.vocab} and "
                         f"{cfg.length} positions; model {model.name} has {io.dim}, "
                         f"{model.vocab_size} and {model.layout.length}")
    from safetensors.torch import load_file

    head = DraftHead(cfg)
    try:
        head.load_state_dict(load_file(str(weights)))
    except Exception as e:  # safetensors' own error type, or a shape mismatch
        raise ValueError(f"{weights} cannot be loaded as this head: {str(e)[:200]}") from None
    head.target = record
    return head.to(model.device).eval()


def resolve_drafter(drafter, model: ImageModel) -> DraftHead | None:  # noqa: ANN001
    """None, a loaded DraftHead (checked against the model), a folder or "shipped"."""
    if drafter is None or isinstance(drafter, DraftHead):
        if isinstance(drafter, DraftHead):
            io = model.draft_io()
            fp = drafter.target.get("fingerprint")
            if io is None or fp != io.fingerprint:
                raise ValueError(f"this draft head was trained for {drafter.target.get('model')}"
                                 f" weights {fp}, not for this {model.name}")
        return drafter
    if not isinstance(drafter, (str, Path)):
        raise ValueError(f"drafter must be a head folder, 'shipped' or a DraftHead, got "
                         f"{type(drafter).__name__}")
    return load_head(drafter, model)
