"""The embedded default data: a deterministic, generated image folder with visually distinct classes.

Nothing is downloaded: each image is drawn with Pillow from a seeded random generator. Eight shape classes
(circle, square, triangle, cross, star, ring, stripes, checker) are drawn as repeated patterns at a random
phase, size, slight rotation and brightness in muted colours over a noisy gradient background, so that colour
and position carry no class information, any crop still shows the class, and a representation has to see
shape. (Colours are muted on purpose: vivid random colours would let instance discrimination succeed on
colour alone, and a self-supervised model would learn colour instead of shape.) Written as an ordinary labeled folder
(``root/<class>/<class>_00000.png``) that every ``moco`` command accepts.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circle", "square", "triangle", "cross", "star", "ring", "stripes", "checker")


def _polygon(cx: float, cy: float, r: float, n: int, angle: float, inner: float | None = None) -> list[tuple]:
    """Vertices of a regular polygon (or a star when ``inner`` is the inner radius ratio)."""
    points = []
    steps = n * 2 if inner is not None else n
    for i in range(steps):
        radius = r * (inner if inner is not None and i % 2 else 1.0)
        theta = angle + 2 * math.pi * i / steps
        points.append((cx + radius * math.cos(theta), cy + radius * math.sin(theta)))
    return points


def _tint(rng: np.random.Generator, level: float) -> np.ndarray:
    """A muted colour of brightness ``level`` (0-255): grey with a small random tint."""
    return np.clip(level + rng.normal(0, 18, size=3), 0, 255)


def _background(rng: np.random.Generator, size: int, level: float) -> Image.Image:
    c0, c1 = _tint(rng, level - 10), _tint(rng, level + 10)
    t = np.linspace(0, 1, size)[None, :, None]
    grad = c0 * (1 - t) + c1 * t  # 1 x W x 3
    img = np.repeat(grad, size, axis=0)
    if rng.random() < 0.5:
        img = img.transpose(1, 0, 2)
    img = img + rng.normal(0, 10, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def _draw_one(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, angle: float, fill) -> None:
    width = max(1, int(r * 0.4))
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        draw.polygon(_polygon(cx, cy, r * 1.2, 4, angle), fill=fill)
    elif kind == "triangle":
        draw.polygon(_polygon(cx, cy, r * 1.3, 3, angle), fill=fill)
    elif kind == "star":
        draw.polygon(_polygon(cx, cy, r * 1.3, 5, angle, inner=0.45), fill=fill)
    elif kind == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=width)
    elif kind == "cross":
        for a in (angle, angle + math.pi / 2):
            dx, dy = r * math.cos(a), r * math.sin(a)
            draw.line([cx - dx, cy - dy, cx + dx, cy + dy], fill=fill, width=width)
    else:
        raise ValueError(f"unknown shape class {kind!r}; expected one of {CLASSES}")


def draw_shape(kind: str, rng: np.random.Generator, size: int = 64) -> Image.Image:
    """One RGB image of class ``kind`` (one of :data:`CLASSES`), ``size`` x ``size`` pixels.

    Shapes are drawn as a loose 3x3 grid of copies (jittered, with a random phase, size, slight rotation and
    colour per image), so any crop of the image still shows the class; stripes and checkers fill the image.
    """
    # Nuisances stay within what MoCo's augmentations undo (brightness jitter, crops, flips), so the one cue
    # that tells images apart after augmentation is the pattern itself: learning it is learning the class.
    background = rng.uniform(70, 130)
    foreground = background + rng.uniform(70, 100)
    img = _background(rng, size, background)
    draw = ImageDraw.Draw(img)
    fill = tuple(int(c) for c in _tint(rng, foreground))
    if kind in ("stripes", "checker"):
        cell = max(3, int(rng.uniform(0.12, 0.16) * size))
        vertical = rng.random() < 0.5
        for y in range(0, size, cell):
            for x in range(0, size, cell):
                if kind == "checker":
                    on = (x // cell + y // cell) % 2 == 0
                else:
                    on = ((x if vertical else y) // cell) % 2 == 0
                if on:
                    draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=fill)
        return img
    per_side = 3
    pitch = size / per_side
    r = pitch * rng.uniform(0.3, 0.38)
    angle = rng.normal(0, 0.15)
    offset = rng.uniform(0, pitch, size=2)
    for i in range(-1, per_side + 1):
        for j in range(-1, per_side + 1):
            cx, cy = offset[0] + i * pitch, offset[1] + j * pitch
            jitter = rng.normal(0, pitch * 0.05, size=2)
            _draw_one(draw, kind, cx + jitter[0], cy + jitter[1], r, angle, fill)
    return img


def write_demo_dataset(
    root: str | Path, per_class: int = 100, size: int = 64, seed: int = 0, classes: tuple[str, ...] = CLASSES
) -> Path:
    """Write ``per_class`` PNG images of each class under ``root/<class>/`` (deterministic for a seed).

    Existing files are overwritten, so rerunning gives the same folder. Returns ``root``.
    """
    root = Path(root)
    for class_index, kind in enumerate(classes):
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([seed, class_index])
        for i in range(per_class):
            draw_shape(kind, rng, size).save(folder / f"{kind}_{i:05d}.png")
    return root
