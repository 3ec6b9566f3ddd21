"""``siftpipe log ...``: summaries, plots, what-if, keys and verification of an audit log."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from typing import Any

import numpy as np

from .._secrets import redact, secret_values
from ..audit.reader import (
    RepeatedParts,
    asked_and_absent,
    describe_missing,
    list_parts,
    listing_problems,
    log_filesystem,
    not_handed_on,
    predecode_tables,
    read_checked,
    read_log,
    unhanded_ranges,
    verify_log,
    wholly_superseded,
)
from ..audit.replay import WhatIf, format_whatif, warn_losses, whatif
from ..audit.summary import SUMMARY_COLUMNS, plot_log, print_summary, summarize
from ..core.policies import (
    Policy,
    PruneEasy,
    RelativeProbabilistic,
    TopFraction,
    Uniform,
)
from ..errors import ConfigError
from .options import add_storage_option_flag, parse_storage_options

__all__ = ["add_cli"]


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="root of the audit log (s3://bucket/prefix, a path, any fsspec URL)")
    add_storage_option_flag(parser)
    parser.add_argument("--run", action="append", help="only this run id (repeatable)")
    parser.add_argument("--rank", type=int, action="append", help="only this rank (repeatable)")


def _read(args: argparse.Namespace, columns: list[str] | None, predecode: bool = False) -> Any:
    return read_log(
        args.url,
        parse_storage_options(args.storage_option),
        run=args.run,
        rank=args.rank,
        columns=columns,
        include_predecode=predecode,
        progress=sys.stderr.isatty(),
    )


def _no_log(args: argparse.Namespace, what: str = "no audit log", why: str | None = None) -> int:
    """Say on stderr that ``args.url`` holds nothing to work on, and ``why`` (default: the
    likeliest reason); the exit status (1, as verify)."""
    shown = redact(args.url, secret_values(parse_storage_options(args.storage_option), args.url))
    where = "".join(f" --run {r}" for r in args.run or ()) + "".join(f" --rank {r}" for r in args.rank or ())
    print(f"siftpipe: {what} at {shown}{where}: {why or _why_nothing(args)}", file=sys.stderr)
    return 1


_UNREADABLE = (
    "its manifests list {n} part(s) and none could be read (damaged or deleted: the warnings "
    "above name them); `siftpipe log verify` says what is wrong with each"
)


def _no_records(args: argparse.Namespace, what: str = "no records") -> int:
    """``_no_log`` for a read that found no records: a log whose runs wrote none (``what``), one
    whose parts are all unreadable, or no log at all, said apart (found by review, 2026-12-05:
    summary and plot said the first for all three)."""
    _, infos, attempts = list_parts(
        args.url, parse_storage_options(args.storage_option), run=args.run, rank=args.rank
    )
    if infos:
        return _no_log(args, "no readable record", _UNREADABLE.format(n=len(infos)))
    return _nothing(args, attempts, what)


def _why_nothing(args: argparse.Namespace) -> str:
    """The likeliest reason a URL holds no log, and its fix."""
    if _INSIDE_LOG.search(args.url.rstrip("/")):
        return (
            "the URL points inside a log (a run=.../rank=... folder): give the log's root, the "
            "folder that holds the run=... folders, and pick streams with --run/--rank"
        )
    bucket = _missing_bucket(args)
    if bucket is not None:
        return f"the bucket {bucket!r} does not exist at this endpoint: check its name and the endpoint"
    return "check the URL, the storage options and --run/--rank"


# a URL that names a run's or a stream's folder, not the log's root
_INSIDE_LOG = re.compile(r"/run=[^/]+(?:/rank=-?\d+)?$")


def _missing_bucket(args: argparse.Namespace) -> str | None:
    """The bucket of an object-store URL, if the store says it does not exist (None otherwise, or
    if it cannot be asked)."""
    scheme, sep, rest = args.url.partition("://")
    if not sep or scheme not in ("s3", "s3a", "gs", "gcs", "az", "abfs"):
        return None
    bucket = rest.split("/", 1)[0].rpartition("@")[2]
    try:
        fs, _ = log_filesystem(f"{scheme}://{bucket}", parse_storage_options(args.storage_option))
        return None if fs.exists(bucket) else bucket
    except Exception:
        return None


def _nothing(args: argparse.Namespace, attempts: list[Any], what: str = "no records") -> int:
    """``_no_log`` when ``list_parts`` found no part: attempts that wrote none (an empty run, or
    one that kept nothing in storage) are not a missing log."""
    if attempts:
        return _no_log(
            args, what, "its runs wrote no records (they decided nothing, or kept nothing in storage)"
        )
    return _no_log(args)


def _cmd_summary(args: argparse.Namespace) -> int:
    # every decision: the stage's, and the drops of samples before decode (PreDecodeFilter)
    s = summarize(_read(args, SUMMARY_COLUMNS, predecode=True))
    if args.json:
        print(json.dumps(s, indent=1))
    elif s.get("records"):
        print_summary(s, sys.stdout)
    return 0 if s.get("records") else _no_records(args)


def _cmd_plot(args: argparse.Namespace) -> int:
    if args.output == "":  # (before reading the log, which may be large: the review of 2026-12-06)
        raise ConfigError("log plot: the plot needs a file name: -o NAME.png (or a folder)")
    table = _read(args, ["seq", "kept", "loss", "score", "prob"])
    if table.num_rows == 0:
        return _no_records(args, "no records to plot")
    print(f"wrote {plot_log(table, args.output)}")
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    options = parse_storage_options(args.storage_option)
    fs, infos, attempts = list_parts(args.url, options, run=args.run, rank=args.rank)
    if not infos:
        return _nothing(args, attempts)
    # rows a pass was left before handing on were never trained: not kept, as read_log reads them
    unhanded = unhanded_ranges(attempts)
    want_kept = not args.dropped
    out = sys.stdout
    keyless = 0
    read = 0
    broken = 0  # keys holding a line break
    end = "\0" if args.null else "\n"

    def write(keys: list[str]) -> None:
        nonlocal broken
        breaks = "\0" if args.null else "\n\r"
        broken += sum(1 for k in keys if any(c in k for c in breaks))
        out.writelines(f"{k}{end}" for k in keys)

    absent = asked_and_absent(infos, attempts, args.run, args.rank)
    if absent is not None:
        warnings.warn(absent, RuntimeWarning, stacklevel=2)
    for message, _ in listing_problems(attempts, infos, args.rank):
        warnings.warn(message, RuntimeWarning, stacklevel=2)  # as read_log (and summary) warn
    repeated = RepeatedParts()
    for info in infos:  # (listed in part order within each attempt)
        if info.path is None:
            if not wholly_superseded(info):
                print(f"skipping {describe_missing(info)}", file=sys.stderr)
            continue
        (table,) = read_checked(fs, [info], ["seq", "key", "kept"])
        secrets = secret_values(options, args.url)
        shown = redact(str(info.path), secrets)
        if isinstance(table, Exception):
            # the cause, as read_log says it (its text redacted, as there)
            cause = redact(f"{type(table).__name__}: {table}", secrets)
            print(f"skipping unreadable part {shown}: {cause}", file=sys.stderr)
            continue
        copy_of = repeated.check(info, table.column("seq").to_numpy())
        if copy_of is not None:
            print(f"skipping part {shown}: {copy_of}", file=sys.stderr)
            continue
        read += 1
        table = not_handed_on(table, unhanded.get((info.run, info.rank, info.attempt)))
        seq = table.column("seq").to_numpy()
        kept = table.column("kept").to_numpy(zero_copy_only=False)
        mask = (kept == want_kept) & (seq < info.cutoff)
        keys = table.column("key").to_pylist()
        picked = [keys[i] for i in np.flatnonzero(mask)]
        keyless += sum(k is None for k in picked)
        write([k for k in picked if k is not None])
    if args.dropped:
        # and the samples DataLoader workers dropped before decode (PreDecodeFilter), after them
        for table in predecode_tables(fs, args.url, options, args.run, args.rank, ["key"], False):
            write([str(k) for k in table.column("key").to_pylist()])
    if broken and not args.null:
        # a key with a line break reads as two keys, one per line
        print(
            f"siftpipe: {broken} key(s) hold a line break, so the lines above are not one key each: "
            "pass -0 (--null) to end each key with a NUL byte instead",
            file=sys.stderr,
        )
    elif broken:
        # and with -0 a key holding a NUL byte reads as two (found by review, 2026-12-05)
        print(
            f"siftpipe: {broken} key(s) hold a NUL byte, so the keys above are not one per NUL: "
            "read them with sp.read_log(url, columns=['key', 'kept']) instead",
            file=sys.stderr,
        )
        return 1
    if not read:
        return _no_log(args, "no readable part")  # every part gone or unreadable: not an empty list
    if keyless:
        # a record without a key (a stage run with key=None) printed as "None", which a real
        # key "None" could not be told from
        print(
            f"siftpipe: {keyless} {'kept' if want_kept else 'dropped'} record(s) have no key (the "
            "stage ran with key=None), so they are not listed: give the stage a key to name "
            "samples in the log",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    report = verify_log(args.url, parse_storage_options(args.storage_option), run=args.run, rank=args.rank)
    print("\n".join(report.lines()))
    if not report.streams:
        print(f"siftpipe: {_why_nothing(args)}", file=sys.stderr)
    # 3: nothing wrong with what is there, but a stream's latest attempt never closed, so the
    # log cannot say it holds every decision (a killed job not resumed, or a deleted tail)
    return 0 if report.complete else 1 if not report.ok else 3


def _cmd_whatif(args: argparse.Namespace) -> int:
    # each value checked by the policy it makes, before any reading, and named by its flag (the
    # policy's error named its parameter, "keep must be a fraction": review, 2026-12-06)
    for flag, values, make in (
        ("--beta", args.beta, RelativeProbabilistic),
        ("--top", args.top, TopFraction),
        ("--uniform", args.uniform, Uniform),
        ("--prune", args.prune, PruneEasy),
    ):
        for value in values or ():
            try:
                make(value)
            except ConfigError as exc:
                raise ConfigError(f"log whatif: {flag} {value}: {exc}") from None
    options = parse_storage_options(args.storage_option)
    _, infos, attempts = list_parts(args.url, options, run=args.run, rank=args.rank)
    if not infos:
        return _nothing(args, attempts)
    # each run's logged window and anneal point, as --beta takes the window (found by review,
    # 2026-12-05: PruneEasy's defaults flipped decisions the logged PruneEasy made; and runs of
    # other windows in one log were all replayed with the first run's, flipping decisions of a
    # complete log)
    windows: dict[str, tuple[int, Any]] = {}
    for info in infos:
        stage = info.manifest.get("stage") if info.manifest else None
        if stage and info.run not in windows:
            config = stage.get("policy_config") or {}
            anneal = config.get("anneal") if stage.get("policy") == "prune_easy" else None
            # (a number or nothing: a damaged manifest's other value would not even key a dict)
            anneal = anneal if isinstance(anneal, int | float) and not isinstance(anneal, bool) else None
            windows[info.run] = (int(config.get("history", 500)), anneal)
    first = next(iter(windows.values()), (500, None))
    groups: dict[tuple[int, Any], list[str]] = {}
    for run in sorted({info.run for info in infos}):
        groups.setdefault(windows.get(run, first), []).append(run)
    absent = asked_and_absent(infos, attempts, args.run, args.rank)
    if absent is not None and len(groups) > 1:  # (with one group, read_log says so)
        warnings.warn(absent, RuntimeWarning, stacklevel=2)
    merged: list[WhatIf] = []
    for (history, anneal), runs in groups.items():
        policies: list[Policy] = [RelativeProbabilistic(beta=b, history=history) for b in args.beta or ()]
        policies += [TopFraction(k) for k in args.top or ()]
        policies += [Uniform(k) for k in args.uniform or ()]
        policies += [PruneEasy(r, anneal=anneal, history=history) for r in args.prune or ()]
        if not policies:
            policies = [RelativeProbabilistic(beta=b, history=history) for b in (0.5, 1.0, 3.0)]
        only = args.run if len(groups) == 1 else runs
        results = whatif(
            args.url, policies, storage_options=options, run=only, rank=args.rank, say_losses=False
        )
        merged = results if not merged else [_add_whatif(a, b) for a, b in zip(merged, results, strict=True)]
    # once, over every group (each group's own counts contradicted the table: the review of it)
    warn_losses(merged[0].no_loss, merged[0].remembered, merged[0].samples)
    logged = merged[0].logged_kept / merged[0].samples
    if args.json:
        print(json.dumps({"logged_keep_rate": logged, "results": [r.as_dict() for r in merged]}, indent=1))
    else:
        print(format_whatif(merged, logged))
    return 0


def _add_whatif(a: WhatIf, b: WhatIf) -> WhatIf:
    """One policy's what-if over two sets of runs, each replayed with its own logged window."""
    return WhatIf(
        policy=a.policy if a.policy == b.policy else f"{a.policy} / {b.policy}",
        samples=a.samples + b.samples,
        kept=a.kept + b.kept,
        logged_kept=a.logged_kept + b.logged_kept,
        to_kept=a.to_kept + b.to_kept,
        to_dropped=a.to_dropped + b.to_dropped,
        keep=np.concatenate([a.keep, b.keep]),
        after_gap=a.after_gap + b.after_gap,
        flips_after_gap=a.flips_after_gap + b.flips_after_gap,
        no_loss=a.no_loss + b.no_loss,
        remembered=a.remembered + b.remembered,
    )


def add_cli(commands: Any) -> None:
    log = commands.add_parser("log", help="inspect an audit log: summary, plot, whatif, keys, verify")
    sub = log.add_subparsers(dest="log_command", required=True, metavar="LOG_COMMAND")

    p = sub.add_parser("summary", help="totals, keep rate over time, loss quantiles, most-dropped shards")
    _common(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_summary)

    p = sub.add_parser(
        "plot", help="keep rate over sequence, loss histograms, keep probability vs percentile"
    )
    _common(p)
    p.add_argument("-o", "--output", default="sift.png", help="PNG to write")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("whatif", help="re-run policies over the logged losses: keep rates and flips")
    _common(p)
    p.add_argument(
        "--beta",
        type=float,
        nargs="+",
        help="RelativeProbabilistic betas, over the logged policy's history window (500 samples "
        "where the logged policy has none, as InfoBatch, the recipe's; with no policy option at "
        "all: 0.5 1 3)",
    )
    p.add_argument("--top", type=float, nargs="+", help="TopFraction keep fractions")
    p.add_argument("--uniform", type=float, nargs="+", help="Uniform keep fractions")
    p.add_argument("--prune", type=float, nargs="+", help="PruneEasy ratios")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_whatif)

    p = sub.add_parser("keys", help="print sample keys, one per line")
    _common(p)
    p.add_argument(
        "-0",
        "--null",
        action="store_true",
        help="end each key with a NUL byte, not a newline (keys that hold line breaks; xargs -0)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--dropped", action="store_true", help="keys of dropped samples")
    group.add_argument("--kept", action="store_true", help="keys of kept samples (the default)")
    p.set_defaults(func=_cmd_keys)

    p = sub.add_parser(
        "verify",
        help="gaps, duplicates, missing, unreadable or altered parts; exit 1 on problems, "
        "3 if a stream's latest attempt never closed (the log may lack its last decisions)",
    )
    _common(p)
    p.set_defaults(func=_cmd_verify)
