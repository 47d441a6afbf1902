"""The ``moco`` console command: argparse subcommands that build typed configs and call the packages.

Every :class:`~contracts.errors.MocoError` becomes ``moco: error: <one line>`` on stderr and its exit code;
Ctrl-C exits with 130 and says how to continue. Heavy imports (torch) happen inside the subcommands, so
``moco --help`` is instant. ``-v`` (debug) and ``-q`` (warnings only) work in any position, before or after the
subcommand; :func:`setup_logging` is the one logging setup of every ``moco`` process (``--workers`` too).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from moco_retrieval.contracts.errors import ConfigError, MocoError

# One module per subcommand, each with ``register(subparsers)``; add new commands here.
COMMAND_MODULES = tuple(
    f"moco_retrieval.app.cmd_{name}"
    for name in ("train", "export", "eval", "index", "embed", "embeddings", "demo", "serve", "duplicates")
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moco",
        description="Learn image representations without labels (MoCo v2/v3), export them to ONNX, index an image "
        "folder with FAISS and serve similarity search.",
    )
    from moco_retrieval import __version__

    parser.add_argument("--version", action="version", version=f"moco-retrieval {__version__}")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("-v", "--verbose", action="store_true", help="debug logging (anywhere on the line)")
    loudness.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only (anywhere on the line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


# packages of an optional install -> what to install (pyproject.toml's extras)
_TRAIN, _RUNTIME = "'moco-retrieval[train]'", "'moco-retrieval[cpu]' (or '[gpu]' on a machine with a GPU)"
INSTALL_FOR = {
    "torch": _TRAIN,
    "torchvision": _TRAIN,
    "timm": _TRAIN,
    "matplotlib": _TRAIN,
    "safetensors": _TRAIN,
    "faiss": _RUNTIME,
    "onnxruntime": _RUNTIME,
}

LOUDNESS = {"-v": logging.DEBUG, "--verbose": logging.DEBUG, "-q": logging.WARNING, "--quiet": logging.WARNING}
QUIET_LOGGERS = {
    "faiss.loader": logging.WARNING,  # lists the CPU variants it tried at INFO: noise to a user
    "PIL": logging.INFO,  # a DEBUG line per PNG chunk read would bury -v's own lines
}


def setup_logging(level: int = logging.INFO) -> None:
    """The log format and levels of a ``moco`` process."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name, floor in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(max(level, floor))


def split_loudness(argv: list[str]) -> tuple[int, list[str]]:
    """``(log level, argv without -v/-q)``: the flags count wherever they stand (up to a ``--``)."""
    level, rest = logging.INFO, []
    for i, arg in enumerate(argv):
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg in LOUDNESS:
            level = LOUDNESS[arg]
        else:
            rest.append(arg)
    return level, rest


def main(argv: list[str] | None = None) -> int:
    level, argv = split_loudness(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(level)
    try:
        return args.func(args)
    except MocoError as exc:
        print(f"moco: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        install = INSTALL_FOR.get((exc.name or "").split(".")[0])
        if install is None:
            raise
        print(
            f"moco: error: `moco {args.command}` needs {exc.name}, which this install lacks: pip install {install}",
            file=sys.stderr,
        )
        return ConfigError.exit_code
    except BrokenPipeError:  # `moco search ... | head`: the reader left; no traceback, as a SIGPIPE'd tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit fails too
        return 128 + 13
    except KeyboardInterrupt:
        print("moco: interrupted; completed work is saved, rerun the same command to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
