"""``moco demo``: the whole flow on generated example images."""

from __future__ import annotations

import argparse


def cmd_demo(args: argparse.Namespace) -> int:
    from moco_retrieval.app.demo import run_demo

    run_demo(args.out, budget=args.time_budget, device=args.device, serve=args.serve, host=args.host, port=args.port)
    return 0


def register(sub) -> None:
    from moco_retrieval.app.demo import DEMO_EPOCHS, DEMO_STEPS

    p = sub.add_parser(
        "demo",
        help="run the whole flow on generated example images",
        description="Generate 1,600 labeled example images (8 pattern classes), train a ResNet-18 "
        "MoCo v2 encoder on them, report its k-NN accuracy against "
        "random initialisation, export it to ONNX, index the images and serve them.",
    )
    p.add_argument("--out", default="demo", help="folder for the demo's data and artifacts (default ./demo)")
    p.add_argument(
        "--time-budget",
        default=None,
        metavar="DURATION",
        help=f"train for this long (e.g. 5m) instead of the default {DEMO_EPOCHS} epochs ({DEMO_STEPS} steps of "
        "256 images; the whole demo takes about 4 minutes on 2 CPU cores)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument(
        "--no-serve",
        dest="serve",
        action="store_false",
        help="stop after building the index instead of serving it (default: serve the web app at "
        "http://127.0.0.1:7860/ until Ctrl-C)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the demo server listens on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port of the demo server (default 7860)")
    p.set_defaults(func=cmd_demo)
