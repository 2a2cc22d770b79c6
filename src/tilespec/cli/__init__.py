"""The ``tilespec`` command line. Each module in this package adds its subcommands through ``register(sub)``.

A command module defines ``register(subparsers)`` which adds parsers whose ``func(args) -> int`` runs the command.
Modules are discovered, so adding a command never touches this file.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; ``command``: only the one of the module of that name when it registers it (a
    command runs without importing every other command's modules: ``tilespec serve`` starts its engine process
    sooner), else all."""
    parser = argparse.ArgumentParser(prog="tilespec", description="Exact, fast speculative decoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    if command in names:
        module = importlib.import_module(f"{__name__}.{command}")
        if hasattr(module, "register"):
            module.register(sub)
            if command in sub.choices:
                return parser
        parser = argparse.ArgumentParser(prog="tilespec", description="Exact, fast speculative decoding.")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as err:
        if getattr(args, "debug", False):
            raise
        print(f"tilespec {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
