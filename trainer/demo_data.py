"""The embedded default data: a deterministic, generated image folder with visually distinct classes.

Nothing is downloaded: each image is drawn with Pillow from a seeded random generator. Eight shape classes
(circle, square, triangle, cross, star, ring, stripes, checker) are drawn at a random position, size,
rotation and colour over a noisy two-colour gradient background, so that colour and position carry no class
information and a useful representation has to see shape. Written as an ordinary labeled folder
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


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    c0, c1 = rng.uniform(0, 255, size=(2, 3))
    t = np.linspace(0, 1, size)[None, :, None]
    grad = c0 * (1 - t) + c1 * t  # 1 x W x 3
    img = np.repeat(grad, size, axis=0)
    if rng.random() < 0.5:
        img = img.transpose(1, 0, 2)
    img = img + rng.normal(0, 12, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def _contrasting_colour(rng: np.random.Generator, background: Image.Image) -> tuple[int, int, int]:
    mean = np.asarray(background).reshape(-1, 3).mean(0)
    for _ in range(20):
        colour = rng.uniform(0, 255, size=3)
        if np.abs(colour - mean).sum() > 180:
            break
    return tuple(int(c) for c in colour)


def draw_shape(kind: str, rng: np.random.Generator, size: int = 64) -> Image.Image:
    """One RGB image of shape class ``kind`` (one of :data:`CLASSES`), ``size`` x ``size`` pixels."""
    img = _background(rng, size)
    draw = ImageDraw.Draw(img)
    fill = _contrasting_colour(rng, img)
    r = rng.uniform(0.22, 0.38) * size
    cx, cy = rng.uniform(r, size - r, size=2)
    angle = rng.uniform(0, 2 * math.pi)
    width = max(2, int(r * 0.35))
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        draw.polygon(_polygon(cx, cy, r * 1.1, 4, angle), fill=fill)
    elif kind == "triangle":
        draw.polygon(_polygon(cx, cy, r * 1.15, 3, angle), fill=fill)
    elif kind == "star":
        draw.polygon(_polygon(cx, cy, r * 1.15, 5, angle, inner=0.45), fill=fill)
    elif kind == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=width)
    elif kind == "cross":
        for a in (angle, angle + math.pi / 2):
            dx, dy = r * math.cos(a), r * math.sin(a)
            draw.line([cx - dx, cy - dy, cx + dx, cy + dy], fill=fill, width=width)
    elif kind == "stripes":
        period = max(4, int(rng.uniform(0.12, 0.2) * size))
        vertical = rng.random() < 0.5
        for offset in range(0, size, period):
            box = [offset, 0, offset + period // 2, size] if vertical else [0, offset, size, offset + period // 2]
            draw.rectangle(box, fill=fill)
    elif kind == "checker":
        cell = max(4, int(rng.uniform(0.12, 0.2) * size))
        for y in range(0, size, cell):
            for x in range(0, size, cell):
                if (x // cell + y // cell) % 2 == 0:
                    draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=fill)
    else:
        raise ValueError(f"unknown shape class {kind!r}; expected one of {CLASSES}")
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
