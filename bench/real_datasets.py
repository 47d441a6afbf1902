#!/usr/bin/env python3
"""Build small real labeled image collections from Debian packages, for learning curves and benchmarks (never
used by the tests: nothing here is downloaded at run time; the packages are installed with apt-get first).

Layout produced under --out:
    <name>/<class>/<image>.png              full collection
    <name>_split/{train,val}/<class>/...    deterministic ~80/20 split
    <name>/README.txt, <name>/stats.json
    summary.json

Rules applied to every collection:
  * output is RGB PNG; transparency composited onto white (tuxpaint, icons,
    openclipart); grayscale sources converted to RGB
  * images larger than 256 px on a side are downscaled (Pillow LANCZOS via
    Image.thumbnail, aspect kept); nothing is upscaled except sklearn_digits
    (8x8 -> 32x32 nearest-neighbour, see its README)
  * dropped: unreadable, min side < 16 px, aspect ratio > 8, near-uniform
    (grayscale stddev < 2.0), exact pixel duplicates (first kept; real files
    are visited before symlinks, then sorted by class/path)
  * openclipart only: cropped to the non-white content box (+ small margin)
    before downscaling, since many drawings sit small on a page-sized canvas
  * only classes with >= 10 images are kept
  * split: per class, sort file names, every 5th file (index % 5 == 4) -> val
  * split files are hard links to the full-collection files (use
    --copy to write real copies instead)

Requires Pillow (run it with the project's .venv/bin/python) and, for the
tuxpaint SVG stamps, rsvg-convert (Debian librsvg2-bin).

Source packages (install with apt-get):
  tuxpaint         tuxpaint-stamps-default, librsvg2-bin
  icons            oxygen-icon-theme
  fashion_mnist    dataset-fashion-mnist
  openclipart      openclipart-png
  sklearn_digits   python3-sklearn (.deb only downloaded + unpacked, not installed)

Usage:
  PYTHONDONTWRITEBYTECODE=1 nice python \
      bench/real_datasets.py [--only a,b] [--copy] [--out DIR]
"""

import argparse
import collections
import datetime
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile

from PIL import Image, ImageChops, ImageStat

Image.MAX_IMAGE_PIXELS = 200_000_000

MAX_SIDE = 256
MIN_SIDE = 16
MAX_ASPECT = 8.0
MIN_STD = 2.0
MIN_PER_CLASS = 10
VAL_EVERY = 5

TUX_ROOT = "/usr/share/tuxpaint/stamps"
OXY_ROOT = "/usr/share/icons/oxygen/base"
FMNIST_ROOT = "/usr/share/datasets/fashion-mnist"
OCA_ROOT = "/usr/share/openclipart/png"
FMNIST_CLASSES = [
    "tshirt_top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle_boot",
]


def pkg_version(pkg):
    try:
        return subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, check=True
        ).stdout
    except Exception:
        return "not installed"


# ---------------------------------------------------------------- image utils
def to_rgb_on_white(im):
    """Return an RGB image; any transparency composited on white."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        im = im.point(lambda v: v / 256).convert("L")
    has_alpha = (
        im.mode in ("RGBA", "LA", "La", "RGBa", "PA")
        or (im.mode == "P" and "transparency" in im.info)
        or (im.mode in ("L", "RGB") and "transparency" in im.info)
    )
    if has_alpha:
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        bg.alpha_composite(im)
        return bg.convert("RGB")
    return im.convert("RGB")


def trim(im):
    """Crop an RGB-on-white image to its non-white content plus a small margin."""
    diff = ImageChops.difference(im, Image.new("RGB", im.size, (255, 255, 255))).convert("L")
    bb = diff.point(lambda v: 255 if v > 8 else 0).getbbox()
    if bb is None:
        return im
    m = 2 + int(0.03 * max(bb[2] - bb[0], bb[3] - bb[1]))
    bb = (max(0, bb[0] - m), max(0, bb[1] - m), min(im.size[0], bb[2] + m), min(im.size[1], bb[3] + m))
    return im.crop(bb)


def fit(im):
    if max(im.size) > MAX_SIDE:
        im = im.copy()
        im.thumbnail((MAX_SIDE, MAX_SIDE), Image.LANCZOS)
    return im


def check(im):
    """Return None if ok, else a reason string."""
    w, h = im.size
    if min(w, h) < MIN_SIDE:
        return "tiny"
    if max(w, h) / min(w, h) > MAX_ASPECT:
        return "aspect"
    if ImageStat.Stat(im.convert("L")).stddev[0] < MIN_STD:
        return "uniform"
    return None


def render_svg(path):
    """Render an SVG with rsvg-convert to fit in MAX_SIDE x MAX_SIDE."""
    out = subprocess.run(
        ["rsvg-convert", "-a", "-w", str(MAX_SIDE), "-h", str(MAX_SIDE), "-b", "white", path],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    im = Image.open(io.BytesIO(out))
    im.load()
    return im


# ---------------------------------------------------------------- sources
# Each source yields (class, out_basename, loader, is_symlink, src_desc)
# where loader() returns a PIL image (any mode).


def flat_name(rel):
    rel = os.path.splitext(rel)[0]
    return rel.replace(os.sep, "__").replace(" ", "_")


def src_tuxpaint():
    for cat in sorted(os.listdir(TUX_ROOT)):
        cdir = os.path.join(TUX_ROOT, cat)
        if not os.path.isdir(cdir):
            continue
        for dp, dn, fn in os.walk(cdir):
            dn.sort()
            stems_png = {os.path.splitext(f)[0] for f in fn if f.lower().endswith(".png")}
            for f in sorted(fn):
                p = os.path.join(dp, f)
                rel = os.path.relpath(p, cdir)
                stem, ext = os.path.splitext(f)
                ext = ext.lower()
                if ext == ".png":
                    yield cat, flat_name(rel), (lambda p=p: Image.open(p)), os.path.islink(p), p
                elif ext == ".svg" and stem not in stems_png:
                    # SVG-only stamps are rasterised; when both exist the PNG is used
                    yield cat, flat_name(rel), (lambda p=p: render_svg(p)), os.path.islink(p), p


def src_icons():
    # one size per (category, icon name): the largest square size <= 128
    best = {}
    sizes = []
    for sd in os.listdir(OXY_ROOT):
        try:
            s = int(sd.split("x")[0])
        except ValueError:
            continue
        if 32 <= s <= 128:
            sizes.append((s, sd))
    for s, sd in sorted(sizes):
        sdir = os.path.join(OXY_ROOT, sd)
        for cat in os.listdir(sdir):
            cdir = os.path.join(sdir, cat)
            if not os.path.isdir(cdir):
                continue
            for f in os.listdir(cdir):
                if f.endswith(".png"):
                    best[(cat, f)] = os.path.join(cdir, f)  # larger size overwrites
    for (cat, f), p in sorted(best.items()):
        yield cat, os.path.splitext(f)[0], (lambda p=p: Image.open(p)), os.path.islink(p), p


def _idx(path):
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    magic = struct.unpack(">I", data[:4])[0]
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return dims, data[4 + 4 * ndim :]


def src_fashion_mnist():
    for part, pre in (("train", "train"), ("test", "t10k")):
        dims, pix = _idx(os.path.join(FMNIST_ROOT, f"{pre}-images-idx3-ubyte.gz"))
        _, lab = _idx(os.path.join(FMNIST_ROOT, f"{pre}-labels-idx1-ubyte.gz"))
        n, h, w = dims
        assert len(lab) == n
        for i in range(n):
            buf = pix[i * h * w : (i + 1) * h * w]
            yield (
                FMNIST_CLASSES[lab[i]],
                f"{part}_{i:05d}",
                (lambda buf=buf, w=w, h=h: Image.frombytes("L", (w, h), buf)),
                False,
                f"{pre}-images-idx3-ubyte.gz[{i}]",
            )


OCA_SKIP = {"unsorted", "special"}  # no label / gradients+patterns
# ~1,370 machine-generated star polygons (star_<N>pt<M>step.png), near-duplicates
OCA_SKIP_RE = re.compile(r"^shapes/stars/star_\d+pt\d+step\.png$")


def src_openclipart():
    for cat in sorted(os.listdir(OCA_ROOT)):
        cdir = os.path.join(OCA_ROOT, cat)
        if cat in OCA_SKIP or not os.path.isdir(cdir):
            continue
        for dp, dn, fn in os.walk(cdir):
            dn.sort()
            for f in sorted(fn):
                if f.lower().endswith(".png"):
                    p = os.path.join(dp, f)
                    if OCA_SKIP_RE.match(os.path.relpath(p, OCA_ROOT)):
                        continue
                    yield (cat, flat_name(os.path.relpath(p, cdir)), (lambda p=p: Image.open(p)), os.path.islink(p), p)


DIGITS_CACHE = None  # set in main: <out>/.src/sklearn_digits.csv.gz


def ensure_digits():
    if os.path.exists(DIGITS_CACHE):
        return
    os.makedirs(os.path.dirname(DIGITS_CACHE), exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        subprocess.run(["apt-get", "download", "-qq", "python3-sklearn"], cwd=td, check=True)
        deb = [f for f in os.listdir(td) if f.endswith(".deb")][0]
        subprocess.run(["dpkg-deb", "-x", deb, "x"], cwd=td, check=True)
        src = os.path.join(td, "x/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz")
        shutil.copy(src, DIGITS_CACHE)
        with open(DIGITS_CACHE + ".version", "w") as fh:
            fh.write(deb + "\n")


def src_sklearn_digits():
    ensure_digits()
    with gzip.open(DIGITS_CACHE, "rt") as fh:
        for i, line in enumerate(fh):
            vals = [int(v) for v in line.strip().split(",")]
            pix, lab = vals[:64], vals[64]
            buf = bytes(round(v * 255 / 16) for v in pix)
            yield (
                f"digit_{lab}",
                f"{i:04d}",
                (lambda buf=buf: Image.frombytes("L", (8, 8), buf).resize((32, 32), Image.NEAREST)),
                False,
                f"digits.csv.gz[{i}]",
            )


DATASETS = {
    "tuxpaint": dict(
        src=src_tuxpaint,
        pkgs=["tuxpaint-stamps-default", "librsvg2-bin"],
        how="Tux Paint stamp images from /usr/share/tuxpaint/stamps/<category>/...; class = "
        "first-level category folder. All PNG stamps are used; SVG stamps are used only when "
        "no PNG of the same name exists beside them, rasterised with `rsvg-convert -a -w 256 "
        "-h 256 -b white`. File name = path below the category with '/' -> '__'.",
    ),
    "icons": dict(
        src=src_icons,
        pkgs=["oxygen-icon-theme"],
        how="Oxygen icon theme PNGs from /usr/share/icons/oxygen/base/<size>/<category>/<icon>.png; "
        "class = category (actions, apps, mimetypes, ...). For each (category, icon name) only "
        "the largest size <= 128 px (from 32, 48, 64, 128) is used. Symlinked aliases are "
        "removed by the exact-duplicate check. Not resized (all <= 128 px).",
    ),
    "fashion_mnist": dict(
        src=src_fashion_mnist,
        pkgs=["dataset-fashion-mnist"],
        how="Fashion-MNIST (Zalando product photos, 28x28 grayscale) read from the IDX files in "
        "/usr/share/datasets/fashion-mnist/; all 60,000 train + 10,000 test images, stored as "
        "28x28 RGB PNG (gray replicated). File names: train_NNNNN / test_NNNNN = index in "
        "the original train / t10k file, so the official split can be recovered; "
        "the <name>_split copy uses the common every-5th rule instead. Class names: label 0..9 = "
        + ", ".join(f"{i}:{c}" for i, c in enumerate(FMNIST_CLASSES))
        + ".",
    ),
    "openclipart": dict(
        src=src_openclipart,
        pkgs=["openclipart-png"],
        trim=True,
        how="Open Clip Art Library 0.18 PNG renderings from /usr/share/openclipart/png/<category>/...; "
        "class = first-level category. Categories 'unsorted' (no label) and 'special' "
        "(gradients/patterns) are excluded, and so are the ~1,370 machine-generated star polygons "
        "shapes/stars/star_<N>pt<M>step.png (near-duplicates that would swamp 'shapes'). Transparency composited on white, then (openclipart "
        "only) cropped to the non-white content box (pixels differing from white by > 8) plus a "
        "margin of 2 px + 3% -- many drawings sit small on a page-sized canvas -- then downscaled "
        "to <= 256 px. File name = path below the category with '/' -> '__'. Classes are "
        "imbalanced (computer and shapes dominate).",
    ),
    "sklearn_digits": dict(
        src=src_sklearn_digits,
        pkgs=[],
        how="UCI optical handwritten digits as shipped in scikit-learn "
        "(sklearn/datasets/data/digits.csv.gz, taken from the python3-sklearn .deb with "
        "apt-get download + dpkg-deb -x; the package is not installed). 1797 scanned "
        "handwritten digits, 8x8 pixels with 17 gray levels (0..16 -> 0..255, white digit "
        "on black). NOTE: 8x8 is below the 16 px minimum, so images are upscaled 4x with "
        "nearest-neighbour to 32x32 (pure pixel replication, no new detail).",
    ),
}


# ---------------------------------------------------------------- build
def build(name, spec, out, copy):
    dst = os.path.join(out, name)
    dst_split = os.path.join(out, name + "_split")
    for d in (dst, dst_split):
        if os.path.exists(d):
            shutil.rmtree(d)
    tmp = dst + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)

    cands = list(spec["src"]())
    # real files first, then symlinks, each in (class, name) order
    cands.sort(key=lambda c: (c[3], c[0], c[1]))
    seen = {}
    dropped = collections.Counter()
    dup_examples = []
    kept = collections.defaultdict(list)
    used_names = set()
    for cls, base, loader, is_link, desc in cands:
        try:
            im = loader()
            im.load()
            im = to_rgb_on_white(im)
            if spec.get("trim"):
                im = trim(im)
            im = fit(im)
        except Exception as e:  # unreadable / conversion failure
            dropped["error"] += 1
            print(f"  [{name}] error {desc}: {e}", file=sys.stderr)
            continue
        why = check(im)
        if why:
            dropped[why] += 1
            continue
        h = hashlib.md5(im.tobytes() + repr(im.size).encode()).hexdigest()
        if h in seen:
            dropped["duplicate"] += 1
            if len(dup_examples) < 5:
                dup_examples.append(f"{desc} == {seen[h]}")
            continue
        seen[h] = desc
        fname = base
        k = 1
        while (cls, fname) in used_names:
            k += 1
            fname = f"{base}_{k}"
        used_names.add((cls, fname))
        os.makedirs(os.path.join(tmp, cls), exist_ok=True)
        im.save(os.path.join(tmp, cls, fname + ".png"))
        kept[cls].append((fname + ".png", im.size))

    # class filter
    small = {c: len(v) for c, v in kept.items() if len(v) < MIN_PER_CLASS}
    for c in small:
        shutil.rmtree(os.path.join(tmp, c))
        del kept[c]
    os.rename(tmp, dst)

    # split
    split_counts = {}
    for cls in sorted(kept):
        files = sorted(f for f, _ in kept[cls])
        ntr = nva = 0
        for i, f in enumerate(files):
            part = "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"
            d = os.path.join(dst_split, part, cls)
            os.makedirs(d, exist_ok=True)
            s, t = os.path.join(dst, cls, f), os.path.join(d, f)
            if copy:
                shutil.copy2(s, t)
            else:
                try:
                    os.link(s, t)
                except OSError:
                    shutil.copy2(s, t)
            if part == "val":
                nva += 1
            else:
                ntr += 1
        split_counts[cls] = (ntr, nva)

    sizes = [s for v in kept.values() for _, s in v]
    longs = [max(s) for s in sizes]
    shorts = [min(s) for s in sizes]
    stats = dict(
        name=name,
        packages={p: pkg_version(p) for p in spec["pkgs"]},
        built=datetime.datetime.now().isoformat(timespec="seconds"),
        num_classes=len(kept),
        num_images=len(sizes),
        num_train=sum(a for a, _ in split_counts.values()),
        num_val=sum(b for _, b in split_counts.values()),
        per_class={c: dict(total=len(kept[c]), train=split_counts[c][0], val=split_counts[c][1]) for c in sorted(kept)},
        dropped=dict(dropped),
        dropped_small_classes=small,
        duplicate_examples=dup_examples,
        long_side=dict(min=min(longs), median=statistics.median(longs), max=max(longs)),
        short_side=dict(min=min(shorts), median=statistics.median(shorts), max=max(shorts)),
        distinct_sizes=len(set(sizes)),
        most_common_sizes=[f"{w}x{h}:{n}" for (w, h), n in collections.Counter(sizes).most_common(5)],
        candidates=len(cands),
    )
    if name == "sklearn_digits" and os.path.exists(DIGITS_CACHE + ".version"):
        deb = open(DIGITS_CACHE + ".version").read().strip()  # python3-sklearn_<ver>_all.deb
        ver = deb.split("_")[1].replace("%3a", ":")
        stats["packages"]["python3-sklearn (.deb unpacked, not installed)"] = ver
    with open(os.path.join(dst, "stats.json"), "w") as fh:
        json.dump(stats, fh, indent=1)
    write_readme(dst, spec, stats, copy)
    return stats


def write_readme(dst, spec, st, copy):
    L = []
    L.append(f"Dataset: {st['name']}")
    L.append("Source package(s): " + ", ".join(f"{p} {v}" for p, v in st["packages"].items()))
    L.append(f"Built: {st['built']} by bench/real_datasets.py")
    L.append("")
    L.append("How built:")
    L.append("  " + spec["how"])
    L.append(
        "  Common rules: output RGB PNG, transparency composited on white, downscaled with "
        f"Pillow (LANCZOS, aspect kept) to <= {MAX_SIDE} px; dropped images with min side < "
        f"{MIN_SIDE} px, aspect > {MAX_ASPECT:g}, grayscale stddev < {MIN_STD:g} (blank), "
        "exact pixel duplicates (first kept, real files before symlinks); classes with < "
        f"{MIN_PER_CLASS} images removed."
    )
    L.append(
        f"  Split ({os.path.basename(dst)}_split/train|val/<class>/): per class, file names "
        f"sorted, every {VAL_EVERY}th file (index % {VAL_EVERY} == {VAL_EVERY - 1}) -> val, rest -> train. "
        + ("Files are copies." if copy else "Split files are hard links to the files here.")
    )
    L.append("")
    L.append(
        f"Classes: {st['num_classes']}   Images: {st['num_images']}   train: {st['num_train']}   val: {st['num_val']}"
    )
    L.append(
        f"Long side  min/median/max: {st['long_side']['min']}/{st['long_side']['median']}/{st['long_side']['max']} px"
    )
    L.append(
        f"Short side min/median/max: {st['short_side']['min']}/{st['short_side']['median']}/{st['short_side']['max']} px"
    )
    L.append(f"Most common sizes: {', '.join(st['most_common_sizes'])}")
    L.append(f"Candidates considered: {st['candidates']}   dropped: {st['dropped'] or 'none'}")
    if st["dropped_small_classes"]:
        L.append(f"Classes removed (< {MIN_PER_CLASS} images): {st['dropped_small_classes']}")
    L.append("")
    L.append(f"{'class':<24}{'total':>7}{'train':>7}{'val':>6}")
    for c, d in st["per_class"].items():
        L.append(f"{c:<24}{d['total']:>7}{d['train']:>7}{d['val']:>6}")
    with open(os.path.join(dst, "README.txt"), "w") as fh:
        fh.write("\n".join(L) + "\n")


def main():
    global DIGITS_CACHE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder the collections are written to")
    ap.add_argument("--only", default=",".join(DATASETS))
    ap.add_argument("--copy", action="store_true", help="real copies in *_split instead of hard links")
    a = ap.parse_args()
    DIGITS_CACHE = os.path.join(a.out, ".src", "sklearn_digits.csv.gz")
    os.makedirs(a.out, exist_ok=True)
    summ_path = os.path.join(a.out, "summary.json")
    summary = json.load(open(summ_path)) if os.path.exists(summ_path) else {}
    for name in a.only.split(","):
        print(f"building {name} ...", flush=True)
        st = build(name, DATASETS[name], a.out, a.copy)
        summary[name] = {
            k: st[k]
            for k in (
                "packages",
                "num_classes",
                "num_images",
                "num_train",
                "num_val",
                "long_side",
                "short_side",
                "dropped",
            )
        }
        print(
            f"  {name}: {st['num_classes']} classes, {st['num_images']} images "
            f"({st['num_train']} train / {st['num_val']} val), dropped {st['dropped']}, "
            f"small classes removed {st['dropped_small_classes']}",
            flush=True,
        )
        with open(summ_path, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
