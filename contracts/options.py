"""Configuration dataclasses as the one statement of every command-line option.

A field declared with :func:`option` carries its default, its help text, its group in ``--help`` and, where it
differs from the field's name, its flag; :func:`add_arguments` makes the argparse flags of a config class from
those fields, and :func:`from_arguments` builds the config from the parsed arguments. ``moco train``, ``moco
index`` and ``moco serve`` all take their flags from here, so a default is written once, beside its reason, and
``--help`` cannot disagree with the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing


def option(default, help: str, group: str = "options", cli: bool = True, flag: str | None = None, **argparse_kwargs):
    """A config field with its command-line help.

    Args:
        default: the field's default (``dict`` / ``list`` / a function: a fresh value per config).
        help: one line for ``--help`` (the default is appended to it).
        group: the ``--help`` section it is listed in.
        cli: ``False``: the field is not a flag.
        flag: the flag's name when not ``--field-name`` (e.g. ``--out`` for ``out_dir``); a name without dashes
            makes a positional argument.
        argparse_kwargs: passed to ``add_argument`` (``choices``, ``metavar``, ``required``, ...).
    """
    meta = {"help": help, "group": group, "cli": cli, "flag": flag, "argparse": argparse_kwargs}
    if default in (dict, list) or (callable(default) and not isinstance(default, type)):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(annotation):
    """``int | None`` -> int; the type argparse should convert a flag's value to."""
    hints = [a for a in typing.get_args(annotation) if a is not type(None)] if typing.get_args(annotation) else []
    base = hints[0] if hints else annotation
    return {"int": int, "float": float, "str": str, "bool": bool}.get(getattr(base, "__name__", str(base)), base)


def cli_fields(cls, only: typing.Iterable[str] | None = None) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags (all of them, or those named in ``only``, in that order)."""
    flags = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)}
    return [flags[name] for name in only] if only is not None else list(flags.values())


def add_arguments(
    parser: argparse.ArgumentParser, cls, groups: typing.Iterable[str] = (), only: typing.Iterable[str] | None = None
) -> None:
    """Add one flag per command-line field of the dataclass ``cls`` (see :func:`option`), in sections named by
    the fields' groups (``groups`` fixes their order; others follow as they come)."""
    hints = typing.get_type_hints(cls)
    sections = {name: parser.add_argument_group(name) for name in groups}
    for f in cli_fields(cls, only):
        meta = f.metadata
        section = sections.get(meta["group"]) or sections.setdefault(
            meta["group"], parser.add_argument_group(meta["group"])
        )
        kwargs = dict(meta.get("argparse", {}))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default is dataclasses.MISSING:
            default = None
        help_text = meta["help"]
        kind = _value_type(hints[f.name])
        flag = meta.get("flag") or _flag(f.name)
        if not flag.startswith("-"):  # a positional argument
            section.add_argument(f.name, metavar=flag, help=help_text, **kwargs)
            continue
        if kind is bool and "action" not in kwargs:
            if default:  # a switch that is on: the flag turns it off
                section.add_argument(
                    meta.get("flag") or _flag("no_" + f.name),
                    dest=f.name,
                    action="store_false",
                    default=True,
                    help=help_text,
                )
            else:
                section.add_argument(flag, dest=f.name, action="store_true", default=False, help=help_text)
            continue
        if "action" not in kwargs:
            kwargs.setdefault("type", kind)
        if default is not None and default != "" and not kwargs.get("required"):
            help_text += f" (default {default})"
        section.add_argument(flag, dest=f.name, default=default, help=help_text, **kwargs)


def from_arguments(cls, args: argparse.Namespace, **fixed):
    """The ``cls`` of parsed arguments: every flag field found in ``args``, plus ``fixed`` values."""
    values = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **fixed})
