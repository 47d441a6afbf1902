"""``moco demo``: the whole flow on generated example images."""
from __future__ import annotations

import argparse


def cmd_demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    run_demo(args.out, epochs=args.epochs, device=args.device, serve=args.serve, host=args.host, port=args.port)
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the whole flow on generated example images",
                       description="Generate a small labeled image set (shapes), train a ResNet-18 on it briefly "
                                   "and report k-NN accuracy before and after.")
    p.add_argument("--out", default="demo", help="folder for the demo's data and artifacts (default ./demo)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    p.add_argument("--no-serve", dest="serve", action="store_false",
                   help="stop after building the index instead of serving it (default: serve the web app at "
                        "http://127.0.0.1:7860/ until Ctrl-C)")
    p.add_argument("--host", default="127.0.0.1", help="address the demo server listens on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port of the demo server (default 7860)")
    p.set_defaults(func=cmd_demo)
