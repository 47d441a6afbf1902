"""``moco export``: a trained checkpoint's encoder as a self-describing, verified ONNX file."""

from __future__ import annotations

import argparse

EPILOG_EXPORT = """\
The file takes uint8 RGB pixels [N, H, W, 3] at the model's image size (named 'images') and returns
L2-normalized float32 embeddings [N, D] (named 'embeddings'); its metadata says the image size, resize
policy, normalization, architecture and training run, so `moco index` and `moco serve` need nothing else.

A ResNet trained at 32 px or less (the CPU default) embeds at twice its training size: its last stage then
sees a 2x2 map instead of 1x1, and objects look as large as the training crops showed them. On four real
collections that added 2-4 points of nearest-neighbour accuracy (Fashion-MNIST 87.3 -> 90.3%) for 4x the
encoder's work per image; --image-size chooses another size (--image-size 32: the training size).

By default each image is embedded as the mean of its features and its left-right mirror's, so a mirrored copy
embeds identically. On 30-minute runs of four real collections that added 0.6-9.9 points of nearest-neighbour
accuracy on three and cost 0.4 on the fourth (the icons), for twice the encoder's work;
--mirror-average off embeds each image once.

By default the network's BatchNorm statistics are re-estimated at that size on up to 10,000 images of the run's
data folder (or --data), the whitening's sample: training left them at augmented crops of the training size.
On 5-minute runs of three small real collections (seeds 0 and 1) that moved nearest-neighbour accuracy by
+3.9 / +3.3 points (tuxpaint), +1.6 / +2.2 (openclipart) and -0.4 / -1.2 (the icons), and a 30-minute
Fashion-MNIST run by +0.2; --refit-bn off keeps the training's.

By default the embeddings are PCA-whitened: the export embeds up to 10,000 images of the run's data folder
(or --data), centres the features and scales their principal directions to equal variance, and builds that
into the file (D = min(features, images / 4)). It needs no labels; on real collections it added 4-11 points
of nearest-neighbour accuracy to trained encoders. --whiten off keeps the backbone's features as they are.

examples:
  moco export runs/photos --out encoder.onnx                  # the run's last checkpoint
  moco export runs/photos/checkpoint_0100.pt --out e100.onnx  # a particular checkpoint
  moco export runs/photos --out encoder-fp16.onnx --fp16      # half the size, cosine >= 0.999 to fp32
  moco export runs/photos --out raw.onnx --whiten off         # the backbone's features, not whitened
  moco export --init moco_v2_800ep_pretrain.pth.tar --arch resnet50 --image-size 224 --out encoder.onnx \\
      --data photos/                     # official weights as they are, whitened on (and checked with) your photos
"""


def cmd_export(args: argparse.Namespace) -> int:
    from moco_retrieval.contracts.encoder_format import model_label
    from moco_retrieval.contracts.errors import ConfigError
    from moco_retrieval.trainer.export import export_encoder, export_pretrained
    from moco_retrieval.trainer.mirror_average import parse_mirror_average

    if (args.checkpoint is None) == (args.init is None):
        raise ConfigError("give either a run directory / checkpoint or --init SOURCE, not both or neither")
    common = dict(
        fp16=args.fp16,
        opset=args.opset,
        verify=args.verify,
        data_dir=args.data,
        whiten=args.whiten,
        mirror_average=parse_mirror_average(args.mirror_average),
    )
    if args.init is not None:
        if args.refit_bn is not None:
            raise ConfigError("--refit-bn goes with a run's checkpoint; --init keeps the weights file's statistics")
        result = export_pretrained(args.init, args.out, arch=args.arch, image_size=args.image_size, **common)
    else:
        if args.arch is not None:
            raise ConfigError("--arch goes with --init; a run's checkpoint states its own")
        refit_bn = args.refit_bn or "auto"
        result = export_encoder(args.checkpoint, args.out, image_size=args.image_size, refit_bn=refit_bn, **common)
    meta = result.metadata
    if result.checks:
        print(f"verified ONNX Runtime against PyTorch on {result.image_source}:")
        for check in result.checks:
            print(f"  {check.describe(result.tolerance)}")
    else:
        print("verification skipped (--no-verify)")
    size_mb = result.path.stat().st_size / 1e6
    print(f"whitening: {meta['whitening']}; mirror-averaged: {'yes' if meta['mirror_average'] == '1' else 'no'}")
    print(f"BatchNorm statistics: {meta['bn_statistics']}")
    print(
        f"wrote {result.path} ({size_mb:.1f} MB, {meta['precision']}): {model_label(meta)}, "
        f"input uint8 [N, {meta['image_size']}, {meta['image_size']}, 3], output float32 "
        f"[N, {meta['embedding_dim']}]"
    )
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a trained encoder to ONNX for indexing and serving",
        description="Export the encoder of a training run (the query backbone, without the "
        "projection/prediction heads) to one ONNX file, then check that ONNX Runtime "
        "gives the same embeddings as PyTorch on a few of the run's images. The file "
        "is written only if the check passes.",
        epilog=EPILOG_EXPORT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint",
        metavar="RUN_DIR_OR_CHECKPOINT",
        nargs="?",
        default=None,
        help="a run directory from `moco train` (uses its checkpoint_last.pt) or a checkpoint .pt file",
    )
    p.add_argument(
        "--init",
        metavar="SOURCE",
        default=None,
        help="export these weights as they are, without training: a local torchvision or timm state "
        "dict (.pth/.pt/.bin/.safetensors), a facebookresearch/moco or moco-v3 checkpoint; the "
        "metadata records its name and sha256",
    )
    p.add_argument("--arch", default=None, help="with --init: the architecture you expect (checked against the file)")
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="the side in pixels the encoder embeds at (default: the size it trained at, 224 for a ResNet of "
        "other code; twice that for a ResNet whose last stage is a 1x1 map there, such as ResNet-18 at 32 px)",
    )
    p.add_argument(
        "--data",
        "--verify-images",
        dest="data",
        metavar="DIR",
        default=None,
        help="a folder of the images you will index: the whitening is fitted on them and the export verified "
        "with them (default: the run's own data folder; with --init, none, so no whitening)",
    )
    p.add_argument(
        "--whiten",
        default="auto",
        metavar="auto|off|D",
        help="PCA-whiten the embeddings, fitted on --data: auto (default; D = min(features, images / 4), none "
        "with fewer than 200 images), off, or the number of dimensions D to keep",
    )
    p.add_argument(
        "--mirror-average",
        choices=("on", "off"),
        default=None,
        help="embed each image as the mean of its features and its left-right mirror's: on (a mirrored copy "
        "embeds identically; twice the encoder's work; the default) or off",
    )
    p.add_argument(
        "--refit-bn",
        choices=("auto", "off"),
        default=None,
        help="re-estimate the BatchNorm statistics on --data at the embedding size: auto (the default; on the "
        "whitening's sample, with at least 200 readable images) or off (keep the training's crops' statistics)",
    )
    p.add_argument("--out", required=True, metavar="ENCODER_ONNX", help="the .onnx file to write, e.g. encoder.onnx")
    p.add_argument(
        "--fp16",
        action="store_true",
        help="store the network in float16: half the file size, faster on GPUs; input and output types stay the same",
    )
    # No trainer import here (it pulls in torch, and `moco --help` must stay instant); a test keeps the
    # numbers in this help equal to trainer.export's DEFAULT_OPSET / MIN_OPSET / MAX_OPSET.
    p.add_argument(
        "--opset",
        type=int,
        default=None,
        help="ONNX opset version, 14-20 (default 17); lower it only for an old runtime",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the ONNX Runtime vs PyTorch check (not recommended)",
    )
    p.set_defaults(func=cmd_export)
