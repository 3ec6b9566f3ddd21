"""Command-line pieces every command group shares: ``--storage-option NAME=VALUE`` and its parsing."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from .._secrets import is_secret_name
from ..errors import ConfigError

__all__ = ["add_storage_option_flag", "parse_storage_options"]


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``["endpoint_url=http://...", "anon=true"]`` -> fsspec storage options.

    Values ``true``/``false`` become booleans and integers (``-12``, ``0``, ``300``; not ``007``,
    which stays text) become ints; everything else stays a string, and so does any value of a
    credential (``secret=000123``, ``password=TRUE``). Keys with dots nest:
    ``client_kwargs.region_name=us-east-1``. A malformed pair, or a key given both a value and
    nested keys, raises ``ConfigError`` (the command's one-line error, exit status 2) without
    showing the value: it may be a credential.
    """
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, equals, value = pair.partition("=")
        parts = key.split(".")
        if not equals or not all(parts):
            # not echoed: a value given without its name may well be the credential itself
            raise ConfigError(
                "--storage-option takes NAME=VALUE (NAME may nest with dots: a.b=VALUE), got "
                + (
                    f"a value of {len(pair)} characters without a NAME= before it"
                    if not equals or not key
                    else f"the key {key!r}, which has an empty part"
                )
                + " (the value is not shown: it may be a credential)"
            )
        parsed: Any = value
        if not is_secret_name(parts[-1]):
            if value.lower() in ("true", "false"):
                parsed = value.lower() == "true"
            elif _INTEGER.fullmatch(value):
                parsed = int(value)
        target = options
        for depth, parent in enumerate(parts[:-1]):
            below = target.setdefault(parent, {})
            if not isinstance(below, dict):
                raise ConfigError(
                    f"--storage-option {key}=...: {'.'.join(parts[: depth + 1])} was given a value "
                    "before, so it cannot also hold nested keys"
                )
            target = below
        if isinstance(target.get(parts[-1]), dict):
            raise ConfigError(
                f"--storage-option {key}=...: {key} holds nested keys given before "
                f"({key}.<name>=...), so it cannot also be given a value"
            )
        target[parts[-1]] = parsed
    return options


# an integer as people write one: no leading zeros (a code, a zip, a credential keeps them)
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")


def add_storage_option_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        action="append",
        metavar="NAME=VALUE",
        help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000; "
        "S3 credentials come from the AWS environment",
    )
