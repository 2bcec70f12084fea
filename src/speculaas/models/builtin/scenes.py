"""Procedural 64x64 scenes with captions: the training data of the built-in model.

A scene is a background (smooth: flat colour or a sky/sunset gradient; textured: grass, gravel or
brick from photographic textures shipped with the package) with one or two objects on it. Smooth
and textured regions side by side are what content-aware decoding is about, so every scene mixes
both kinds of region. Like a photograph, and unlike a clean rendering, every scene carries a
lighting gradient across the frame, sensor grain, and small jitter in colour, size and place: that
is what makes smooth regions many-coded in a real VQ tokenizer. Rendering is deterministic in the
seed; `render_scene(seed)` for a single scene, `sample_scenes(n, seed)` for a batch.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

import numpy as np
from PIL import Image

SIZE = 64

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "purple": (150, 60, 190),
}
SHAPES = ("circle", "square", "triangle", "diamond")
POSITIONS = ("left", "center", "right")
SIZES = ("small", "big")
# Backgrounds: the first three are smooth, the last three textured (the "ground" under a sky).
BACKGROUNDS = ("blue sky", "sunset", "plain grey", "grass", "gravel", "brick")
SMOOTH_BACKGROUNDS = BACKGROUNDS[:3]
_BG_PHRASES = {
    "blue sky": "under a blue sky", "sunset": "at sunset",
    "plain grey": "on a plain grey background", "grass": "over grass", "gravel": "over gravel",
    "brick": "in front of a brick wall",
}
# The word of a grammar caption that names its background.
BACKGROUND_KEYWORDS = {"sky": "blue sky", "sunset": "sunset", "grey": "plain grey",
                       "grass": "grass", "gravel": "gravel", "brick": "brick"}
TEXTURES = {"grass": (70, 150, 50), "gravel": (150, 140, 130), "brick": (170, 80, 60)}

_X_CENTRE = {"left": 15, "center": 32, "right": 49}
_RADIUS = {"small": 9, "big": 14}
# Photographic variation: strength of the lighting gradient (multiplicative, across the frame),
# the range of the grain's standard deviation (in 0-255 units), colour and size jitter.
LIGHTING = 0.18
GRAIN = (2.0, 5.0)
COLOUR_JITTER = 15.0
SIZE_JITTER = 0.1


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    position: str
    size: str

    @property
    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} on the {self.position}"


@dataclass(frozen=True)
class Scene:
    """A rendered scene: `image` [64, 64, 3] uint8, its caption and attribute labels."""

    image: np.ndarray
    caption: str
    background: str
    objects: tuple[SceneObject, ...]

    @property
    def labels(self) -> dict[str, int]:
        """Class indices of the main (first) object and the background, for the judge."""
        main = self.objects[0]
        return {
            "shape": SHAPES.index(main.shape),
            "colour": list(COLOURS).index(main.colour),
            "background": BACKGROUNDS.index(self.background),
            "position": POSITIONS.index(main.position),
        }


@functools.cache
def _texture(name: str) -> np.ndarray:
    path = resources.files("speculaas.models.builtin") / "textures" / f"{name}.png"
    with resources.as_file(path) as p:
        return np.asarray(Image.open(p).convert("L"), dtype=np.float32) / 255.0


def _gradient(top: tuple[int, ...], bottom: tuple[int, ...], rows: int) -> np.ndarray:
    t = np.linspace(0.0, 1.0, rows, dtype=np.float32)[:, None, None]
    col = (1 - t) * np.array(top, np.float32) + t * np.array(bottom, np.float32)
    return np.broadcast_to(col, (rows, SIZE, 3)).copy()


def _sky(kind: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    jitter = rng.uniform(-15, 15, size=3)
    if kind == "blue sky":
        return _gradient(np.add((70, 130, 230), jitter), (200, 225, 250), rows)
    if kind == "sunset":
        return _gradient(np.add((120, 60, 150), jitter), (250, 150, 60), rows)
    return np.broadcast_to(np.add((150, 150, 150), jitter), (rows, SIZE, 3)).astype(np.float32)


def _ground(kind: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    tex = _texture(kind)
    y, x = rng.integers(0, tex.shape[0] - rows + 1), rng.integers(0, tex.shape[1] - SIZE + 1)
    patch = tex[y : y + rows, x : x + SIZE, None]
    tint = np.array(TEXTURES[kind], np.float32)
    return np.clip(tint * (0.35 + 1.3 * patch), 0, 255)


def _background(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind in SMOOTH_BACKGROUNDS:
        return _sky(kind, SIZE, rng)
    # Textured ground under a smooth sky: the horizon sits in the upper half.
    horizon = int(rng.integers(16, 33))
    sky = _sky(("blue sky", "sunset")[int(rng.integers(2))], horizon, rng)
    return np.concatenate([sky, _ground(kind, SIZE - horizon, rng)], axis=0)


def _lighting(rng: np.random.Generator) -> np.ndarray:
    """A multiplicative light falloff across the frame in a random direction, [SIZE, SIZE, 1]."""
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = (np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5) / SIZE - 0.5
    ramp = np.cos(angle) * xx + np.sin(angle) * yy  # in [-0.71, 0.71]
    return (1.0 + LIGHTING * rng.uniform(0.3, 1.0) * ramp / 0.71)[..., None]


def _mask(obj: SceneObject, cy: float, cx: float, r: float) -> np.ndarray:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5
    dy, dx = yy - cy, xx - cx
    if obj.shape == "circle":
        return dy**2 + dx**2 <= r**2
    if obj.shape == "square":
        return (np.abs(dy) <= r * 0.85) & (np.abs(dx) <= r * 0.85)
    if obj.shape == "diamond":
        return np.abs(dy) + np.abs(dx) <= r * 1.15
    # Upward triangle: apex at the top, base at the bottom.
    h = (dy + r) / (2 * r)
    return (h >= 0) & (h <= 1) & (np.abs(dx) <= h * r)


def _caption(objects: tuple[SceneObject, ...], background: str) -> str:
    text = f"{objects[0].phrase} {_BG_PHRASES[background]}"
    if len(objects) > 1:
        text += f" and {objects[1].phrase}"
    return text


def render_scene(seed: int) -> Scene:
    """Render the scene with this seed. The same seed always gives the same pixels and caption."""
    rng = np.random.default_rng(seed)
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    n_objects = 2 if rng.random() < 0.3 else 1
    positions = rng.permutation(len(POSITIONS))[:n_objects]
    colours = rng.permutation(len(COLOURS))[:n_objects]
    objects = tuple(
        SceneObject(
            shape=SHAPES[int(rng.integers(len(SHAPES)))],
            colour=list(COLOURS)[int(c)],
            position=POSITIONS[int(p)],
            size=SIZES[int(rng.integers(len(SIZES)))] if i == 0 else "small",
        )
        for i, (p, c) in enumerate(zip(positions, colours, strict=True))
    )
    img = _background(background, rng)
    for obj in objects:
        cy = 40 + rng.uniform(-4, 4)
        cx = _X_CENTRE[obj.position] + rng.uniform(-3, 3)
        r = _RADIUS[obj.size] * (1 + rng.uniform(-SIZE_JITTER, SIZE_JITTER))
        m = _mask(obj, cy, cx, r)
        colour = np.array(COLOURS[obj.colour], np.float32) + rng.uniform(
            -COLOUR_JITTER, COLOUR_JITTER, size=3)
        shade = 1.0 - 0.25 * np.clip((np.mgrid[0:SIZE, 0:SIZE][0] - cy) / 24, -1, 1)[..., None]
        img = np.where(m[..., None], np.clip(colour * shade, 0, 255), img)
    img = img * _lighting(rng)
    img = img + rng.normal(0.0, rng.uniform(*GRAIN), size=img.shape)
    image = np.clip(img, 0, 255).round().astype(np.uint8)
    return Scene(image=image, caption=_caption(objects, background), background=background,
                 objects=objects)


def sample_scenes(n: int, seed: int) -> list[Scene]:
    """`n` scenes with seeds `seed, seed + 1, ...`."""
    return [render_scene(seed + i) for i in range(n)]


# Caption vocabulary: every word the grammar can produce, plus the special tokens.
PAD, NULL, BOI = "<pad>", "<null>", "<image>"
WORDS = (
    PAD, NULL, BOI, "a", "on", "the", "and", "under", "blue", "sky", "at", "sunset", "plain",
    "grey", "background", "over", "grass", "gravel", "in", "front", "of", "brick", "wall",
    *SIZES, *COLOURS, *SHAPES, *POSITIONS,
)
CAPTION_LEN = 24  # longest caption is 21 words; the image-start token follows


_OBJECT = (rf"a ({'|'.join(SIZES)}) ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)}) "
           rf"on the ({'|'.join(POSITIONS)})")
_CAPTION = re.compile(rf"{_OBJECT} ({'|'.join(_BG_PHRASES.values())})(?: and {_OBJECT})?")
GRAMMAR = (f"a SIZE COLOUR SHAPE on the POSITION BACKGROUND [and a SIZE COLOUR SHAPE on the "
           f"POSITION]; SIZE: {' | '.join(SIZES)}; COLOUR: {' | '.join(COLOURS)}; "
           f"SHAPE: {' | '.join(SHAPES)}; POSITION: {' | '.join(POSITIONS)}; "
           f"BACKGROUND: {' | '.join(_BG_PHRASES.values())}")


def normalise_caption(caption: str) -> str:
    """Lower case, punctuation dropped, single spaces: "A big red circle, on the left." works."""
    return " ".join(re.sub(r"[^a-z ]+", " ", caption.lower()).split())


# Natural ways of saying what the grammar says (after normalise_caption): synonyms of its words,
# and the background phrases people write. Order matters: longer phrases first.
_SYNONYMS = {"gray": "grey", "centre": "center", "middle": "center", "large": "big",
             "huge": "big", "little": "small", "tiny": "small", "an": "a", "one": "a"}
_BG_NATURAL = (
    ("brick", r"(?:(?:in front of|against|before|by|next to) )?(?:a )?(?:red )?brick wall"
              r"(?: background)?"),
    ("plain grey", r"(?:(?:on|against|over|in front of|with) )?(?:a )?(?:plain )?grey"
                   r" background"),
    ("blue sky", r"(?:(?:under|below|beneath|against|with|in) )?(?:a |the )?(?:blue )?sky"),
    ("sunset", r"(?:(?:at|during|in|with) )?(?:a |the )?sunset(?: sky)?"),
    ("grass", r"(?:(?:over|on|in|above|with) )?(?:the |some )?(?:green )?grass(?: background)?"),
    ("gravel", r"(?:(?:over|on|in|above|with) )?(?:the |some )?gravel(?: background)?"),
)
_OBJECT_NATURAL = re.compile(
    rf"a (?:({'|'.join(SIZES)}) )?({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})"
    rf"(?: (?:on|in|at|to) the ({'|'.join(POSITIONS)}))?")
DEFAULT_BACKGROUND = "blue sky"


def _natural(text: str) -> tuple[list[tuple[str, str, str, str | None]], str | None, str]:
    """(objects as (size or "", colour, shape, position or None), background or None, what is
    left over) read from a normalised caption, in the order the user wrote them."""
    text = " ".join(_SYNONYMS.get(w, w) for w in text.split())
    background = None
    for name, pattern in _BG_NATURAL:
        m = re.search(rf"(?:^| ){pattern}(?: |$)", text)
        if m:
            background = name
            text = (text[: m.start()] + " " + text[m.end():]).strip()
            break
    objects = []
    rest = text
    for m in _OBJECT_NATURAL.finditer(text):
        objects.append((m.group(1) or "", m.group(2), m.group(3), m.group(4)))
        rest = rest.replace(m.group(0), " ", 1)
    rest = " ".join(w for w in rest.split() if w not in ("and", "with", "plus", "next", "to"))
    return objects, background, rest


def _canonical(objects: list, background: str) -> str:
    phrases = [f"a {size or ('big' if i == 0 else 'small')} {colour} {shape} on the {position}"
               for i, (size, colour, shape, position) in enumerate(objects)]
    text = f"{phrases[0]} {_BG_PHRASES[background]}"
    return text + (f" and {phrases[1]}" if len(phrases) > 1 else "")


# Words that ask for two of a shape ("two blue squares", "a pair of circles"); a plural shape
# word does too. The grammar draws them as two objects, left and right.
_TWO = {"two", "pair", "both", "twin"}
_PLURALS = {f"{s}s": s for s in SHAPES}


def _nearest_caption(words: list[str]) -> str:
    """A valid caption built from every attribute word the input has, object by object (a shape
    word closes an object; a position after it belongs to it; "two" or a plural shape word makes
    two alike), defaults for the rest; "in the middle" where the grammar says "on the center"
    (both are read, and the second reads as English)."""
    words = [_SYNONYMS.get(w, w) for w in words]
    objects, pending, two = [], {}, False
    for w in words:
        if w in _TWO:
            two = True
        if w in _PLURALS:
            w, two = _PLURALS[w], True
        for key, options in (("size", SIZES), ("colour", COLOURS), ("position", POSITIONS)):
            if w in options:
                if key == "position" and objects and objects[-1]["position"] is None \
                        and not pending:
                    objects[-1]["position"] = w
                else:
                    pending[key] = w
        if w in SHAPES:
            obj = {"size": pending.get("size", ""), "shape": w, "colour": pending.get("colour"),
                   "position": pending.get("position")}
            if two:  # two alike: side by side unless the first was placed
                pair = ("left", "right") if obj["position"] is None else (obj["position"], None)
                objects += [{**obj, "position": pair[0]}, {**obj, "position": pair[1], "size": ""}]
            else:
                objects.append(obj)
            pending, two = {}, False
    if not objects:
        objects = [{"size": pending.get("size", ""), "shape": "circle",
                    "colour": pending.get("colour"), "position": pending.get("position")}]
    objects = objects[:2]
    free = [p for p in POSITIONS if p not in {o["position"] for o in objects}]
    free_colours = [c for c in COLOURS if c not in {o["colour"] for o in objects}]
    if len(objects) == 2 and objects[0]["position"] == objects[1]["position"]:
        objects[1]["position"] = None  # two objects in one place: not a scene the model draws
        free = [p for p in POSITIONS if p != objects[0]["position"]]
    for o in objects:
        o["position"] = o["position"] or free.pop(0)
        o["colour"] = o["colour"] or free_colours.pop(0)
    background = next((BACKGROUND_KEYWORDS[w] for w in words if w in BACKGROUND_KEYWORDS),
                      DEFAULT_BACKGROUND)
    text = _canonical([(o["size"], o["colour"], o["shape"], o["position"]) for o in objects],
                      background)
    return text.replace("on the center", "in the middle")


# Words natural captions may use besides the grammar's.
_EXTRA_WORDS = {"with", "plus", "next", "to", "against", "before", "by", "below", "beneath",
                "during", "above", "some", "red", "green", "sky"}


def canonical_caption(caption: str) -> str | None:
    """The grammar's caption for a natural one (optional size, "in the center"/"in the middle",
    an optional background, default under a blue sky, objects and background in either
    order), or None where the words do not read as one or two placed objects."""
    objects, background, rest = _natural(normalise_caption(caption))
    if rest or not 1 <= len(objects) <= 2 or any(o[3] is None for o in objects):
        return None
    if len(objects) == 2 and objects[0][3] == objects[1][3]:
        return None  # two objects in one place: not a scene the model draws
    text = _canonical(objects, background or DEFAULT_BACKGROUND)
    return text if _CAPTION.fullmatch(text) else None


def parse_caption(caption: str) -> str:
    """The normalised caption if the grammar (`GRAMMAR`) produces it, or the grammar's caption
    for a natural one (canonical_caption), else a ValueError that names the unknown words or
    shows the nearest valid caption, built from every attribute the input names."""
    if not isinstance(caption, str):
        raise ValueError(f"the built-in model takes caption strings or None, got {caption!r}")
    text = normalise_caption(caption)
    words = text.split()
    unknown = sorted({w for w in words if (w not in WORDS and w not in _SYNONYMS
                                           and w not in _EXTRA_WORDS and w not in _TWO
                                           and w not in _PLURALS) or w in (PAD, NULL, BOI)})
    if unknown:
        shapes = {_PLURALS.get(w, w) for w in words} & set(SHAPES)
        what = "" if shapes else (
            f" (it draws one or two shapes, {', '.join(SHAPES)}, in {', '.join(COLOURS)}, "
            f"over {', '.join(BACKGROUNDS)})")
        raise ValueError(f"caption {caption!r} uses words the built-in model does not know: "
                         f"{unknown}{what}; try {_nearest_caption(words)!r}")
    if not _CAPTION.fullmatch(text):
        natural = canonical_caption(text)
        if natural is not None:
            return natural
        raise ValueError(f"caption {caption!r} does not follow the built-in grammar; nearest "
                         f"valid caption: {_nearest_caption(words)!r}")
    return text


def tokenize_caption(caption: str | None, *, null: bool = False) -> list[int]:
    """Word ids of `caption` padded to CAPTION_LEN, then the image-start id.

    `null=True` (or `caption=None`) gives the unconditional prefix used for classifier-free
    guidance: every caption slot holds the null token.
    """
    if caption is None or null:
        ids = [WORDS.index(NULL)] * CAPTION_LEN
    else:
        words = parse_caption(caption).split()  # the grammar caps it at 21 words
        ids = [WORDS.index(w) for w in words] + [WORDS.index(PAD)] * (CAPTION_LEN - len(words))
    return ids + [WORDS.index(BOI)]
