"""``moco demo``: the whole flow on generated example images."""
from __future__ import annotations

import argparse


def cmd_demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    run_demo(args.out, epochs=args.epochs, device=args.device)
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the whole flow on generated example images",
                       description="Generate a small labeled image set (shapes), train a ResNet-18 on it briefly "
                                   "and report k-NN accuracy before and after.")
    p.add_argument("--out", default="demo", help="folder for the demo's data and artifacts (default ./demo)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.set_defaults(func=cmd_demo)
