"""The ``moco`` console command: argparse subcommands that build typed configs and call the packages.

Every :class:`~contracts.errors.MocoError` becomes ``moco: error: <one line>`` on stderr and its exit code;
Ctrl-C exits with 130 and says how to continue. Heavy imports (torch) happen inside the subcommands, so
``moco --help`` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from moco_retrieval.contracts.errors import MocoError

# One module per subcommand, each with ``register(subparsers)``; add new commands here.
COMMAND_MODULES = ("moco_retrieval.app.cmd_train", "moco_retrieval.app.cmd_export", "moco_retrieval.app.cmd_eval", "moco_retrieval.app.cmd_index", "moco_retrieval.app.cmd_demo", "moco_retrieval.app.cmd_serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moco",
        description="Learn image representations without labels (MoCo v2/v3), export them to ONNX, index an image "
                    "folder with FAISS and serve similarity search.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise to a user
    try:
        return args.func(args)
    except MocoError as exc:
        print(f"moco: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("moco: interrupted; completed work is saved, rerun the same command to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
