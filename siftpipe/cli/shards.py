"""``siftpipe shards write``: write a synthetic classification set to WebDataset shards."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .._secrets import redact_url
from ..errors import ConfigError, ShardError
from ..streaming.shards import synthetic_classification, write_shards
from .options import add_storage_option_flag, parse_storage_options


def add_cli(subparsers: Any) -> None:
    """``siftpipe shards write URL --samples N --per-shard M [--storage-option K=V ...]``."""
    shards = subparsers.add_parser("shards", help="write WebDataset tar shards")
    commands = shards.add_subparsers(dest="shards_command", required=True, metavar="COMMAND")
    write = commands.add_parser(
        "write",
        help="write a synthetic classification dataset (easy redundant samples, hard tail) to shards",
        description="Write a synthetic classification dataset to WebDataset shards URL-000000.tar, ... "
        "(x.npy float32 features, cls labels, hard.cls flags; no pickle). Prints a JSON summary.",
    )
    write.add_argument("url", help="shard prefix: s3://bucket/data/train, file:///data/train or a local path")
    write.add_argument("--samples", type=int, required=True, help="number of samples")
    write.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    write.add_argument("--dim", type=int, default=16, help="feature dimension (default 16)")
    write.add_argument("--classes", type=int, default=4, help="number of classes (default 4)")
    write.add_argument(
        "--hard-fraction", type=float, default=0.1, help="fraction of hard samples (default 0.1)"
    )
    write.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    write.add_argument("--quiet", action="store_true", help="no progress bar")
    write.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the shards already at URL (and remove those of them this write does not "
        "replace); without it, a URL that holds shards is refused",
    )
    add_storage_option_flag(write)
    write.set_defaults(func=_cli_write)


def _cli_write(args: argparse.Namespace) -> int:
    if args.samples < 1:
        # a usage error: exit status 2, as the other commands' (and argparse's)
        raise ConfigError(f"shards write: --samples must be >= 1, got {args.samples}")
    if args.seed < 0:  # (numpy's own error for it was a traceback, exit status 1)
        raise ConfigError(f"shards write: --seed must be >= 0, got {args.seed}")
    # named by their flags, before any work (the library's errors named its parameters, one
    # after a progress bar had started: review, 2026-12-06)
    for flag, value, least in (
        ("--per-shard", args.per_shard, 1),
        ("--dim", args.dim, 2),
        ("--classes", args.classes, 2),
    ):
        if value < least:
            raise ConfigError(f"shards write: {flag} must be >= {least}, got {value}")
    if not 0.0 <= args.hard_fraction <= 1.0:
        raise ConfigError(f"shards write: --hard-fraction must be in [0, 1], got {args.hard_fraction}")
    # a malformed --storage-option too, and any settings error write_shards raises (ConfigError:
    # no filesystem for the URL's protocol, options of the wrong type); a shard the destination
    # did not take (ShardError) is a failure, status 1
    storage_options = parse_storage_options(args.storage_option)
    samples = synthetic_classification(
        args.samples, dim=args.dim, classes=args.classes, hard_fraction=args.hard_fraction, seed=args.seed
    )
    try:
        written = write_shards(
            samples,
            args.url,
            existing="replace" if args.overwrite else "refuse",
            samples_per_shard=args.per_shard,
            storage_options=storage_options,
            progress=not args.quiet,
            total=args.samples,
        )
    except ShardError as exc:
        raise SystemExit(f"siftpipe shards write: {exc}") from None
    print(
        json.dumps(
            {
                "pattern": redact_url(written.pattern),
                "shards": len(written.urls),
                "samples": written.samples,
                "samples_per_shard": args.per_shard,
            }
        )
    )
    return 0
