"""``moco eval knn`` / ``moco eval linear``: top-1 accuracy of a trained encoder on labeled folders.

MODEL is a run directory, a checkpoint, or an exported ``.onnx`` encoder; an ONNX file is run through the
indexer's ONNX Runtime encoder, exactly as ``moco index`` and ``moco serve`` will run it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moco_retrieval.contracts.knn import EVAL_KS, KNN_TEMPERATURE

EPILOG_EVAL = """\
examples:
  moco eval knn --train shapes/train --test shapes/val runs/shapes
  moco eval knn --train shapes/train --test shapes/val runs/shapes/encoder.onnx --out results/knn.json
  moco eval knn --train shapes/train --test shapes/val runs/shapes --pixels   # and against raw pixels
  moco eval linear --train shapes/train --test shapes/val runs/shapes/checkpoint_0100.pt --epochs 200
  moco eval knn --train photos/train --test photos/val moco_v2_800ep_pretrain.pth.tar --image-size 96
                                        # official weights as they are, to compare with your run after --init

Folders are labeled by their first-level subfolders (<folder>/<class>/<image>). Results print as a table
and are written as JSON to --out (default: eval_<protocol>.json next to MODEL).
"""


def open_model(
    model: str,
    device: str,
    batch_size: int,
    workers: int,
    arch: str | None = None,
    image_size: int | None = None,
    mirror_average: str | None = None,
):
    """An embedder for MODEL: the ONNX encoder for ``.onnx`` files, else the backbone of the checkpoint or
    weights file (torchvision, timm, MoCo v1/v2/v3: what ``moco train --init`` reads); ``mirror_average``:
    ``on`` / ``off`` / None (``moco export``'s default) for the latter."""
    if model.endswith(".onnx"):
        from moco_retrieval.contracts.errors import ConfigError
        from moco_retrieval.indexer.encoder import OnnxEncoder

        if arch is not None or image_size is not None or mirror_average is not None:
            raise ConfigError(
                "--arch, --image-size and --mirror-average go with weights files; an .onnx encoder states its own"
            )
        return OnnxEncoder(model, device=device)
    from moco_retrieval.trainer.evaluate import CheckpointEmbedder
    from moco_retrieval.trainer.mirror_average import parse_mirror_average

    return CheckpointEmbedder(
        model,
        device=device,
        batch_size=batch_size,
        workers=workers,
        arch=arch,
        image_size=image_size,
        mirror_average=parse_mirror_average(mirror_average),
    )


def default_out(model: str, protocol: str) -> Path:
    path = Path(model)
    return (path if path.is_dir() else path.parent) / f"eval_{protocol}.json"


def cmd_eval(args: argparse.Namespace) -> int:
    from moco_retrieval.trainer.evaluate import (
        LinearProbeConfig,
        evaluate,
        format_table,
        write_results,
    )

    embedder = open_model(
        args.model, args.device, args.batch_size, args.workers, args.arch, args.image_size, args.mirror_average
    )
    probe = None
    if args.protocol == "linear":
        probe = LinearProbeConfig(
            epochs=args.epochs,
            batch_size=args.probe_batch_size,
            lr=args.lr,
            weight_decay=args.weight_decay,
            seed=args.seed,
        )
    doc = evaluate(
        args.protocol,
        embedder,
        args.train,
        args.test,
        ks=tuple(getattr(args, "k", EVAL_KS)),
        temperature=getattr(args, "temperature", KNN_TEMPERATURE),
        probe=probe,
        pixels=getattr(args, "pixels", False),
    )
    out = write_results(doc, args.out or default_out(args.model, args.protocol))
    print(format_table(doc))
    print(f"wrote {out}")
    return 0


def _check_positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _k_list(value: str) -> list[int]:
    try:
        ks = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers like 20,200, got {value!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"neighbour counts must be at least 1, got {value!r}")
    return ks


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        metavar="MODEL",
        help="run directory, checkpoint (.pt), exported encoder (.onnx), or a weights file moco train "
        "--init reads (torchvision, timm, facebookresearch/moco or moco-v3) to evaluate; a run or checkpoint "
        "gives the backbone's features as they are, an .onnx file what you will index (whitened by default)",
    )
    p.add_argument(
        "--arch", default=None, help="for a weights file: the architecture you expect (checked against the file)"
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="for a weights file: input size in pixels (default: a ViT's own, a ResNet's training size or 224 "
        "for one of other code, twice that where its last stage is a 1x1 map, as `moco export` does)",
    )
    p.add_argument(
        "--mirror-average",
        choices=("on", "off"),
        default=None,
        help="for a run, checkpoint or weights file: average each image's features with its mirror's, as "
        "`moco export --mirror-average` does: on (default) or off",
    )
    p.add_argument(
        "--train",
        required=True,
        metavar="LABELED_DIR",
        help="labeled folder (<dir>/<class>/<image>) the classifier learns from",
    )
    p.add_argument(
        "--test",
        required=True,
        metavar="LABELED_DIR",
        help="labeled folder (<dir>/<class>/<image>) whose accuracy is reported",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="JSON",
        help="results file (default: eval_<protocol>.json in the run directory / next to MODEL)",
    )
    p.add_argument("--device", default="auto", help="auto (GPU when usable), cpu, cuda or cuda:N (default auto)")
    p.add_argument(
        "--batch-size",
        type=_check_positive,
        default=256,
        help="images per forward pass when computing features (default 256)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="image-decoding processes for checkpoint models (default 0 = in the main process)",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="measure a trained encoder: k-NN or linear-probe top-1 accuracy",
        description="Measure a trained encoder the way the MoCo papers do, on a labeled training "
        "folder and a labeled test folder. Backbone features are computed once "
        "(frozen, eval mode) and reused.",
        epilog=EPILOG_EVAL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    protocols = p.add_subparsers(dest="protocol", metavar="PROTOCOL", required=True)

    knn = protocols.add_parser(
        "knn",
        help=f"weighted k-NN on cosine similarity (k={' and '.join(map(str, EVAL_KS))}, T={KNN_TEMPERATURE})",
        description="Classify each test image by a vote of its k most similar training "
        "images (cosine similarity, votes weighted exp(similarity/T)).",
        epilog=EPILOG_EVAL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(knn)
    knn.add_argument(
        "--k",
        type=_k_list,
        default=list(EVAL_KS),
        metavar="K[,K...]",
        help=f"neighbour counts to report, comma-separated (default {','.join(map(str, EVAL_KS))}; "
        "clipped to the training images)",
    )
    knn.add_argument(
        "--temperature", type=float, default=KNN_TEMPERATURE, help=f"vote temperature T (default {KNN_TEMPERATURE})"
    )
    knn.add_argument(
        "--pixels",
        action="store_true",
        help="also classify by plain L2 k-NN on the raw pixels of the same crops, at the size the model trained "
        "at (k = 1, 5, 20), and print the model's margin over them: features that do not beat raw pixels are "
        "not worth indexing",
    )
    knn.set_defaults(func=cmd_eval)

    linear = protocols.add_parser(
        "linear",
        help="linear classifier trained on frozen features",
        description="Train a linear classifier on the frozen, standardised backbone "
        "features of the training folder; report its test accuracy.",
        epilog=EPILOG_EVAL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(linear)
    linear.add_argument(
        "--epochs", type=_check_positive, default=100, help="passes over the cached features (default 100)"
    )
    linear.add_argument("--lr", type=float, default=0.1, help="peak SGD learning rate, cosine-decayed (default 0.1)")
    linear.add_argument("--weight-decay", type=float, default=0.0, help="L2 on the classifier (default 0)")
    linear.add_argument(
        "--probe-batch-size", type=_check_positive, default=256, help="features per classifier step (default 256)"
    )
    linear.add_argument("--seed", type=int, default=0, help="seed for the classifier's init and shuffling")
    linear.set_defaults(func=cmd_eval)
