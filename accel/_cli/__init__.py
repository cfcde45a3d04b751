"""The ``accel`` command line.

Each subcommand is a module in this package defining::

    NAME: str                      # the word typed after ``accel``
    HELP: str                      # one line for ``accel --help``
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...   # the exit code

Modules are found by listing the package, so adding a subcommand touches no
other file. ``info`` runs when no subcommand is given. A bad argument or an
:class:`~accel.AccelError` ends in one line on stderr and a non-zero exit,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from accel._errors import AccelError

__all__ = ["main", "print_json"]

DEFAULT_COMMAND = "info"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line instead of usage + line
    (as JSON on stdout when the command line asks for ``--json``)."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        # A typed argument may hold a newline or a terminal escape: shown escaped, on one line.
        message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        if _Parser.json_errors:
            _print_error(f"{message} (see '{self.prog} --help')", "UsageError")
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _print_error(message: str, kind: str) -> None:
    """An error as JSON on stdout, ``{"error": ..., "kind": ...}``: what ``--json`` readers parse."""
    print(json.dumps({"error": message, "kind": kind}))


def _subcommands() -> list[ModuleType]:
    modules = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            modules.append(module)
    modules.sort(key=lambda m: (m.NAME != DEFAULT_COMMAND, m.NAME))
    return modules


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="accel",
        description="accel: one runtime API for CUDA, Level Zero and the host CPU.",
    )
    parser.add_argument("--version", action="version", version=f"accel {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in _subcommands():
        sub = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not args_list or args_list[0].startswith("-") and args_list[0] not in ("-h", "--help", "--version"):
        args_list.insert(0, DEFAULT_COMMAND)
    _Parser.json_errors = "--json" in args_list
    try:
        args = parser.parse_args(args_list)
    finally:
        _Parser.json_errors = False
    try:
        return int(args._run(args))
    except AccelError as exc:
        if getattr(args, "json", False):
            _print_error(str(exc), type(exc).__name__)
        else:
            print(f"accel {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`accel info | head`): stop quietly, like coreutils.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # a file that cannot be read or written
        if getattr(args, "json", False):
            _print_error(str(exc), type(exc).__name__)
        else:
            print(f"accel {args.command}: {exc}", file=sys.stderr)
        return 1


def _version() -> str:
    # The version of the code that runs (tests/test_packaging.py checks it is pyproject's).
    version: str = importlib.import_module("accel").__version__
    return version


def print_json(payload: Any) -> None:
    """Print ``payload`` as indented JSON (tuples become lists, unknowns strings)."""
    print(json.dumps(payload, indent=2, sort_keys=True, default=str))
