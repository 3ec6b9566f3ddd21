"""Command-line pieces every command group shares: the ``--storage-option KEY=VALUE`` flag and its parsing."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_storage_option_flag", "parse_storage_options"]


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``["endpoint_url=http://...", "anon=true"]`` -> fsspec storage options.

    Values ``true``/``false`` become booleans and integers become ints; everything else stays a
    string. Keys with dots nest: ``client_kwargs.region_name=us-east-1``.
    """
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, equals, value = pair.partition("=")
        if not equals or not key:
            # not echoed: a value given without its name may well be the credential itself
            raise SystemExit(
                f"siftpipe: error: --storage-option takes KEY=VALUE, got a value of {len(pair)} "
                "characters without a KEY= before it (not shown: it may be a credential)"
            )
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
