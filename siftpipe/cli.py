"""The ``siftpipe`` command line: each command group lives next to the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

#: Modules of this package that each define ``add_cli(subparsers)`` for one command group.
COMMAND_MODULES: tuple[str, ...] = ("demo", "logtools", "shards")


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``["endpoint_url=http://...", "anon=true"]`` -> fsspec storage options.

    Values ``true``/``false`` become booleans and integers become ints; everything else stays a
    string. Keys with dots nest: ``client_kwargs.region_name=us-east-1``.
    """
    options: dict[str, Any] = {}
    for pair in pairs or ():
        if "=" not in pair:
            raise SystemExit(f"--storage-option takes KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        parsed: Any = value
        if value.lower() in ("true", "false"):
            parsed = value.lower() == "true"
        elif value.lstrip("-").isdigit():
            parsed = int(value)
        target = options
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = parsed
    return options


def add_storage_option_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000; "
        "S3 credentials come from the AWS environment",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="siftpipe", description="Sift training data with the live model's loss; inspect the audit log."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"siftpipe.{name}").add_cli(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; a siftpipe error is printed as one line naming the problem (exit status 2)."""
    from .errors import SiftError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SiftError as exc:
        print(f"siftpipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
