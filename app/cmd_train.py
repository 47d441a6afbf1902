"""``moco train``: options of the MoCo trainer and the command that runs it."""
from __future__ import annotations

import argparse
import logging
import os

LOG = logging.getLogger(__name__)

EPILOG_TRAIN = """\
examples:
  moco train photos/ --out runs/photos --arch resnet18 --image-size 96 --epochs 100 --batch-size 256
  moco train photos/ --out runs/photos          # rerun after a crash: continues from checkpoint_last.pt
  torchrun --nproc_per_node=8 -m app.cli train photos/ --out runs/photos   # 8 GPUs, --batch-size is global
"""


def _add_train_options(p: argparse.ArgumentParser) -> None:
    from trainer.config import ARCHS, STEMS

    g = p.add_argument_group("model")
    g.add_argument("--moco-version", type=int, default=2, choices=(2, 3),
                   help="2: MoCo v2 (queue of negatives, SGD; default); 3: MoCo v3 (symmetric in-batch loss, predictor, "
                        "no queue; LARS for ResNets, AdamW for ViTs). Options left unset take that version's paper "
                        "values, listed as 'v2 / v3' below")
    g.add_argument("--arch", default="resnet50", choices=ARCHS,
                   help="backbone network (default resnet50; resnet18 trains fastest; vit_* need --moco-version 3)")
    g.add_argument("--stem", default="auto", choices=STEMS,
                   help="ResNet first layers: 'small' keeps resolution for 32-96 px images, 'imagenet' "
                        "downsamples 4x for larger ones; auto picks by --image-size (default auto)")
    g.add_argument("--patch-size", type=int, default=0,
                   help="ViT patch size in pixels (default 0 = auto: 16, 8 at 96 px and below, 4 at 32 px and below)")
    g.add_argument("--image-size", type=int, default=224, help="training crop size in pixels (default 224)")
    g.add_argument("--dim", type=int, default=None, help="projection output dimension used by the loss (128 / 256)")
    g.add_argument("--mlp-hidden", type=int, default=None,
                   help="hidden width of the projection (and v3 prediction) head; 0 = the backbone's width (0 / 4096)")
    g.add_argument("--queue-size", type=int, default=None,
                   help="v2 only: negative keys remembered from past batches, a multiple of --batch-size (65536)")
    g.add_argument("--momentum", type=float, default=None,
                   help="how slowly the key encoder follows the query encoder, 0-1 (0.999 / 0.99, which v3 raises "
                        "to 1 on a cosine)")
    g.add_argument("--temperature", type=float, default=None,
                   help="softmax temperature of the contrastive loss (0.2 / 1.0 for ResNets, 0.2 for ViTs)")
    g.add_argument("--bn-splits", type=int, default=0,
                   help="v2 only: batch-norm groups in one process so BN cannot reveal the positive pair "
                        "(0 = auto: up to 8 groups of at least 16 images in one process; off under torchrun, which shuffles BN across processes)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=200, help="passes over the data (default 200)")
    g.add_argument("--batch-size", type=int, default=256,
                   help="images per step summed over all processes/GPUs (default 256)")
    g.add_argument("--lr", type=float, default=None,
                   help="base learning rate, multiplied by batch-size/256 (0.03 / 0.6 for ResNets, 1.5e-4 for ViTs)")
    g.add_argument("--no-lr-scale", dest="lr_scale", action="store_false",
                   help="use --lr as given instead of scaling it by batch-size/256")
    g.add_argument("--warmup-epochs", type=float, default=None,
                   help="epochs of linear learning-rate warm-up before the cosine decay (0 / 10%% of --epochs for "
                        "ResNets, 13%% for ViTs)")
    g.add_argument("--weight-decay", type=float, default=None,
                   help="weight decay (1e-4 / 1e-6 for ResNets, 0.1 for ViTs; v3 exempts biases and norms)")
    g = p.add_argument_group("running")
    g.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="image-decoding processes per training process (default: min(4, CPU cores))")
    g.add_argument("--device", default="auto", help="auto (GPU when usable), cpu, cuda or cuda:N (default auto)")
    g.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 mixed precision (default: on for GPU, off for CPU)")
    g.add_argument("--compile", action="store_true", help="torch.compile the encoders (slow start, faster GPU steps)")
    g.add_argument("--seed", type=int, default=0, help="random seed for initialisation, data order and augmentation")
    g.add_argument("--resume", metavar="CHECKPOINT_OR_RUN_DIR", default=None,
                   help="continue from this checkpoint; by default a run directory with checkpoint_last.pt "
                        "continues automatically")
    g.add_argument("--stop-at-epoch", type=int, default=None,
                   help="stop after this many epochs but keep the schedule of --epochs (continue later)")
    g.add_argument("--save-every", type=int, default=10, help="keep a numbered checkpoint every N epochs (default 10)")
    g.add_argument("--save-every-steps", type=int, default=0,
                   help="also save checkpoint_last.pt every N steps inside an epoch, so a killed run loses at most N "
                        "steps (default 0: at epoch ends; Ctrl-C always saves where it stopped)")
    g.add_argument("--log-every", type=int, default=10, help="write metrics every N steps (default 10)")
    g = p.add_argument_group("k-NN monitor")
    g.add_argument("--knn-dir", default=None,
                   help="labeled folder (one subfolder per class, or train/ and val/) to report k-NN accuracy on; "
                        "default: DATA_DIR itself when it has class subfolders")
    g.add_argument("--knn-every", type=int, default=1, help="evaluate k-NN every N epochs (0 = never; default 1)")
    g.add_argument("--knn-k", type=int, default=20, help="neighbours that vote (default 20)")


def _train_config(args: argparse.Namespace):
    from trainer.config import TrainConfig

    return TrainConfig(
        data_dir=args.data_dir, out_dir=args.out, moco_version=args.moco_version, arch=args.arch, stem=args.stem,
        patch_size=args.patch_size, mlp_hidden=args.mlp_hidden,
        image_size=args.image_size, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        lr_scale=args.lr_scale, warmup_epochs=args.warmup_epochs, weight_decay=args.weight_decay,
        queue_size=args.queue_size, momentum=args.momentum, temperature=args.temperature, dim=args.dim,
        bn_splits=args.bn_splits, workers=args.workers, device=args.device, amp=args.amp, compile=args.compile,
        seed=args.seed, knn_dir=args.knn_dir, knn_every=args.knn_every, knn_k=args.knn_k,
        save_every=args.save_every, save_every_steps=args.save_every_steps, log_every=args.log_every,
    )


# Below this global batch the papers' v3 learning rates, scaled by batch/256, learned slowly in measured runs.
SMALL_BATCH = 1024
SMALL_BATCH_RECIPES = {"resnet": "--lr 4.8 --temperature 0.2 --warmup-epochs 1 reached 76% k-NN top-1 from 50% "
                                 "in 800 steps at batch 32",
                       "vit": "--lr 3e-3 --warmup-epochs 1 reached 55% from 44% in 75 steps at batch 64"}


def small_batch_advice(args: argparse.Namespace) -> str | None:
    """A hint for MoCo v3 left at the paper's learning rate with a small batch, or None.

    The paper values assume batches of 1,024-4,096; at batch 32 they learned slowly or not at all on the demo
    data, where a higher lr, T 0.2 and a short warm-up learned quickly (README, "What to expect").
    """
    if args.moco_version != 3 or args.lr is not None or args.batch_size >= SMALL_BATCH:
        return None
    family = "vit" if args.arch.startswith("vit") else "resnet"
    return (f"--batch-size {args.batch_size} with the paper's MoCo v3 learning rate (made for batches of 1024-4096) "
            f"learns slowly; on the demo data {SMALL_BATCH_RECIPES[family]}")


def cmd_train(args: argparse.Namespace) -> int:
    from trainer import dist
    from trainer.train import train

    is_main = dist.world_info_from_env().rank == 0
    advice = small_batch_advice(args)
    if advice and is_main:
        LOG.warning(advice)
    result = train(_train_config(args), resume=args.resume, stop_at_epoch=args.stop_at_epoch)
    if is_main:
        _print_train_result(result)
    return 0


def _print_train_result(result) -> None:
    knn = f", k-NN top-1 {100 * result.knn_acc:.1f}%" if result.knn_acc is not None else ""
    loss = f", loss {result.loss:.3f}" if result.loss is not None else ""
    print(f"trained {result.epochs_done} epochs on {result.images} images ({result.skipped} skipped){loss}{knn}")
    print(f"run directory: {result.run_dir}")



def register(sub) -> None:
    p = sub.add_parser("train", help="train a MoCo encoder on a folder of unlabeled images",
                       description="Train a MoCo encoder on a folder of images (labels are not needed). "
                                   "Writes config.json, checkpoints, metrics.jsonl and metrics.png to --out.",
                       epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_dir", metavar="DATA_DIR", help="folder of images (searched recursively)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory for checkpoints and logs")
    _add_train_options(p)
    p.set_defaults(func=cmd_train)
