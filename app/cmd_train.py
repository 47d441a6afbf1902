"""``moco train``: the MoCo trainer's command. Its options are generated from ``trainer.config.TrainConfig``
(every field's help, type and default), so each option is stated once."""

from __future__ import annotations

import argparse
import logging

LOG = logging.getLogger(__name__)

EPILOG_TRAIN = """\
what --recipe auto does (the default):
  Options you leave unset are derived from your batch size, number of images and time budget, with what
  learned in short runs of our learning curves (MoCo v2 on a CPU: on three real image collections; the
  rest: on the generated demo data). config.json records every derived value and why; --recipe paper uses
  the MoCo papers' values instead. Any flag you pass wins over both.
{recipe}

--time-budget:
  The first minute's measured speed sets the number of steps; the learning-rate, momentum and warm-up
  schedules span the budget, the monitor runs about 10 times, and the run stops on time with a checkpoint.
  Interrupted, the same command continues with the same budget. Caching the images (once per folder and
  image size) happens before the clock starts.

examples:
  moco train photos/ --out runs/photos --arch resnet18 --image-size 96 --time-budget 30m
  moco train photos/ --out runs/photos          # rerun after a crash: continues from checkpoint_last.pt
  moco train photos/ --out runs/paper --recipe paper --epochs 200 --batch-size 256
  moco train photos/ --out runs/ft --init moco_v2_800ep_pretrain.pth.tar --time-budget 30m   # continue official weights
  torchrun --nproc_per_node=8 -m moco_retrieval train photos/ --out runs/photos   # 8 GPUs, --batch-size is global
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
        start = "--init weights" if result.init else "random init"
        before = f" ({start} {100 * result.knn_before:.1f}%)" if result.knn_before is not None else ""
        whitened = (
            f", {100 * result.knn_whitened:.1f}% whitened at the training size (the monitor's; `moco eval knn` "
            "measures the readout `moco export` writes)"
            if result.knn_whitened is not None
            else ""
        )
        knn = f", k-NN top-1 {100 * result.knn_acc:.1f}%{before}{whitened}"
    loss = f", loss {result.loss:.3f}" if result.loss is not None else ""
    print(
        f"trained {result.steps} steps ({result.epochs_trained:.1f} epochs, stopped by {result.stopped_by}) on "
        f"{result.images} images ({result.skipped} skipped){loss}{knn}"
    )
    print(f"run directory: {result.run_dir}")


def register(sub) -> None:
    from moco_retrieval.trainer.config import add_arguments
    from moco_retrieval.trainer.recipe_table import describe

    p = sub.add_parser(
        "train",
        help="train a MoCo encoder on a folder of unlabeled images",
        description="Train a MoCo encoder on a folder of images (labels are not needed). "
        "Writes config.json, checkpoints, metrics.jsonl and metrics.png to --out.",
        epilog=EPILOG_TRAIN.format(recipe=describe()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("data_dir", metavar="DATA_DIR", help="folder of images (searched recursively)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory for checkpoints and logs")
    add_arguments(p)
    p.add_argument(
        "--resume",
        metavar="CHECKPOINT_OR_RUN_DIR",
        default=None,
        help="continue from this checkpoint; by default a run directory with checkpoint_last.pt "
        "continues automatically",
    )
    p.add_argument(
        "--stop-at-epoch",
        type=int,
        default=None,
        help="stop after this many epochs but keep the schedule of --epochs (continue later)",
    )
    p.set_defaults(func=cmd_train)
