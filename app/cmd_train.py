"""``moco train``: the MoCo trainer's command. Its options are generated from ``trainer.config.TrainConfig``
(every field's help, type and default), so each option is stated once."""
from __future__ import annotations

import argparse
import logging

LOG = logging.getLogger(__name__)

EPILOG_TRAIN = """\
what --recipe auto does (the default):
  Options you leave unset are derived from your batch size, number of images and time budget, with what
  learned in short runs of our learning curves. MoCo v2 on a CPU (checked on three real image collections):
  batch 256 (at most half the images), lr 0.06 x batch/256, the longest queue the images allow (the paper's
  65536, capped at half of them). Elsewhere (checked on the generated demo data only): batch 32 for v3 on a
  CPU, on a GPU 1/32 of the images (32-256), lr 8-16x the papers' base lr with a cap at larger batches, a v2
  queue of about a fifth of the images. Always: T = 0.2, a v2 key momentum with an EMA time constant of 1/20
  of the run, a 1-epoch warm-up for v3 and, on a CPU, the cheap ImageNet stem.
  config.json records every derived value and why. --recipe paper uses the MoCo papers' values instead
  (made for batches of 256-4096 and hundreds of epochs).

--time-budget:
  The first minute's measured speed sets the number of steps; the learning-rate, momentum and warm-up
  schedules span the budget, the monitor runs about 10 times, and the run stops on time with a checkpoint.
  Interrupted, the same command continues with the same budget. Caching the images (once per folder and
  image size) happens before the clock starts.

examples:
  moco train photos/ --out runs/photos --arch resnet18 --image-size 96 --time-budget 30m
  moco train photos/ --out runs/photos          # rerun after a crash: continues from checkpoint_last.pt
  moco train photos/ --out runs/paper --recipe paper --epochs 200 --batch-size 256
  torchrun --nproc_per_node=8 -m app.cli train photos/ --out runs/photos   # 8 GPUs, --batch-size is global
"""


def cmd_train(args: argparse.Namespace) -> int:
    from moco_retrieval.trainer import dist
    from moco_retrieval.trainer.config import from_arguments
    from moco_retrieval.trainer.train import train

    cfg = from_arguments(args, data_dir=args.data_dir, out_dir=args.out)
    result = train(cfg, resume=args.resume, stop_at_epoch=args.stop_at_epoch)
    if dist.world_info_from_env().rank == 0:
        _print_train_result(result)
    return 0


def _print_train_result(result) -> None:
    knn = ""
    if result.knn_acc is not None:
        before = f" (random init {100 * result.knn_before:.1f}%)" if result.knn_before is not None else ""
        knn = f", k-NN top-1 {100 * result.knn_acc:.1f}%{before}"
    loss = f", loss {result.loss:.3f}" if result.loss is not None else ""
    print(f"trained {result.steps} steps ({result.epochs_done} epochs, stopped by {result.stopped_by}) on "
          f"{result.images} images ({result.skipped} skipped){loss}{knn}")
    print(f"run directory: {result.run_dir}")


def register(sub) -> None:
    from moco_retrieval.trainer.config import add_arguments

    p = sub.add_parser("train", help="train a MoCo encoder on a folder of unlabeled images",
                       description="Train a MoCo encoder on a folder of images (labels are not needed). "
                                   "Writes config.json, checkpoints, metrics.jsonl and metrics.png to --out.",
                       epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_dir", metavar="DATA_DIR", help="folder of images (searched recursively)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory for checkpoints and logs")
    add_arguments(p)
    p.add_argument("--resume", metavar="CHECKPOINT_OR_RUN_DIR", default=None,
                   help="continue from this checkpoint; by default a run directory with checkpoint_last.pt "
                        "continues automatically")
    p.add_argument("--stop-at-epoch", type=int, default=None,
                   help="stop after this many epochs but keep the schedule of --epochs (continue later)")
    p.set_defaults(func=cmd_train)
