"""The ``siftpipe demo`` job: both runs, the table, the verdict and the plot."""

from __future__ import annotations

import argparse
import errno
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError
from .run import Arm, RunResult, time_to_target, train_options, train_run
from .task import redundant_task, write_task_shards


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def _table(results: Sequence[RunResult]) -> str:
    head = (
        "run",
        "samples seen",
        "samples trained",
        "forward passes",
        "backward passes",
        "wall time",
        "test accuracy",
        "keep rate",
    )
    rows = [
        (
            r.name,
            _fmt_int(r.seen),
            _fmt_int(r.trained),
            _fmt_int(r.forward),
            _fmt_int(r.trained),
            f"{r.seconds:.1f} s",
            f"{100 * r.accuracy:.2f}%",
            f"{r.keep_rate:.3f}",
        )
        for r in results
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in (head, *rows)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(full: RunResult, sifted: RunResult, margin: float = 0.005) -> str:
    """One line comparing the runs, computed from their curves: when did each first reach the full
    run's final accuracy minus ``margin`` (a fraction: 0.005 is half a point)? Times and backward
    samples are interpolated between evaluations (``time_to_target``)."""
    target = full.accuracy - margin
    what = f"the full run's final accuracy minus {100 * margin:.1f} pt ({100 * target:.2f}%)"
    a = time_to_target(full.points, target)
    b = time_to_target(sifted.points, target)
    if a is None:  # cannot happen with margin >= 0: the full run ends at its final accuracy
        raise ValueError("the full run never reached its own final accuracy minus the margin")
    if b is None:
        return (
            f"Sifting did not reach {what} within the same budget: it ended at "
            f"{100 * sifted.accuracy:.2f}% after {sifted.seconds:.1f} s and "
            f"{_fmt_int(sifted.trained)} backward samples "
            f"({sifted.seconds / full.seconds:.2f}x the full run's time, "
            f"{sifted.trained / max(1, full.trained):.2f}x its backward passes)."
        )
    time_ratio = b["seconds"] / a["seconds"] if a["seconds"] > 0 else math.inf
    back_ratio = b["backward"] / a["backward"] if a["backward"] else math.inf
    faster = "less" if time_ratio < 1 else "more"
    return (
        f"Sifting reached {what} after {b['seconds']:.1f} s and {_fmt_int(round(b['backward']))} "
        f"backward samples, the full run after {a['seconds']:.1f} s and {_fmt_int(round(a['backward']))}: "
        f"{abs(1 - time_ratio) * 100:.0f}% {faster} wall time ({time_ratio:.2f}x), "
        f"{back_ratio:.2f}x the backward passes."
    )


def plot_runs(results: Sequence[RunResult], path: str, title: str = "") -> None:
    """Write a PNG: test accuracy against wall time (evaluations excluded), one line per run.

    The left panel shows every evaluation (the y-axis spans them all, the early low ones too);
    the right one zooms on the top of the curves (from 2 points below the lowest final accuracy),
    where the runs' final accuracies differ."""
    from .._optional import require

    require("matplotlib", "the accuracy plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    for r in results:
        for ax in (full, zoom):
            ax.plot(
                [0.0] + [p.seconds for p in r.points],
                [math.nan] + [100 * p.accuracy for p in r.points],
                marker="o",
                ms=3,
                label=f"{r.name} ({100 * r.accuracy:.2f}%)",
            )
    values = [100 * p.accuracy for r in results for p in r.points]
    if values:
        full.set_ylim(max(0.0, min(values) - 2), min(100.0, max(values) + 1))
        last = min(100 * r.points[-1].accuracy for r in results if r.points)
        zoom.set_ylim(max(0.0, last - 2), min(100.0, max(values) + 0.3))
    full.set(
        xlabel="wall time, s (evaluations excluded)", ylabel="test accuracy, %", title="every evaluation"
    )
    zoom.set(xlabel="wall time, s (evaluations excluded)", title="zoom on the top (lower points: left)")
    for ax in (full, zoom):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hold_out(out: str) -> Any:
    """Hold ``out`` for this demo: a second demo into it while this one runs is refused (found by
    review, 2026-12-05: it replaced the shards the first was training on, which then reported
    8% accuracy, or failed on a shard gone). Returns the open lock file (None where the OS has
    no ``fcntl``: not held)."""
    try:
        import fcntl
    except ImportError:  # (Windows)
        return None
    path = os.path.join(out, ".demo.lock")
    try:
        lock = open(path, "a+")  # noqa: SIM115 (held open for the demo's length)
    except OSError as exc:  # (the review of the lock: a read-only --out gave a traceback)
        raise ConfigError(
            f"demo: cannot write in {out} ({exc.strerror or exc}): give an --out that can be written"
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        lock.close()
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None  # a filesystem without locks (some NFS, FUSE): not held, as on Windows
        raise ConfigError(
            f"demo: another siftpipe demo is running in {out} (it holds {path}): wait for it to "
            "end, or give this one another --out"
        ) from None
    return lock


def run_demo(args: argparse.Namespace, storage_options: Mapping[str, Any] | None = None) -> int:
    """The ``siftpipe demo`` command's work, given its parsed flags (``siftpipe.cli.demo`` defines
    them) and the fsspec options for ``--store`` (parsed from ``--storage-option``). One demo at
    a time runs in an ``--out`` folder (a second is refused while the first runs)."""
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    lock = _hold_out(out)
    try:
        return _run_demo(args, storage_options)
    finally:
        if lock is not None:
            lock.close()


def _run_demo(args: argparse.Namespace, storage_options: Mapping[str, Any] | None) -> int:
    import siftpipe as sp

    from .._optional import available, progress_bar

    wall0 = time.perf_counter()
    can_plot = available("matplotlib")
    if not can_plot:
        print(
            "siftpipe demo: no accuracy plot: matplotlib is not installed (pip install 'siftpipe[plot]')",
            file=sys.stderr,
        )
    torch.set_num_threads(max(1, args.threads))
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    options = dict(storage_options or {})
    store = args.store or os.path.join(out, "shards", "train")
    quiet = args.quiet
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    x, y, hard, _ = redundant_task(
        args.samples, hard_fraction=args.hard_fraction, label_noise=args.label_noise, seed=args.task_seed
    )
    xt, yt, _, _ = redundant_task(
        args.test_samples, hard_fraction=args.hard_fraction, seed=args.task_seed, draw=1
    )
    say(
        f"siftpipe demo: {args.samples:,} training samples ({hard.mean():.0%} in the hard tail"
        + (f", {args.label_noise:.0%} labels flipped" if args.label_noise else "")
        + f"), {args.test_samples:,} test samples"
    )
    audit_root = os.path.join(out, "audit")
    if os.path.exists(audit_root) and not os.path.isdir(audit_root):
        # said before anything runs, not after the full run trained (found by review, 2026-12-05)
        raise ConfigError(f"demo: {audit_root} (the audit log's folder) is a file: move it away")
    try:
        # the demo's own folder is replaced; a --store that holds shards only with --overwrite
        written = write_task_shards(
            store,
            x,
            y,
            samples_per_shard=args.per_shard,
            storage_options=options,
            progress=not quiet,
            existing="replace" if not args.store or args.overwrite else "refuse",
        )
    except sp.ShardError as exc:
        raise SystemExit(f"siftpipe demo: {exc}") from None
    # (a ConfigError is the command line's usage error: one line, status 2, as every command's)
    say(f"wrote {len(written.urls)} shards: {written.pattern}")
    test = (torch.from_numpy(xt), torch.from_numpy(yt))
    budget = (
        f"{args.budget_seconds:g} s of training each"
        if args.budget_seconds
        else f"{args.epochs} epochs ({args.epochs * args.samples:,} samples seen) each"
    )
    age = max(0, args.memory_age)
    scoring = (
        f"losses remembered for {age} epoch{'s' if age > 1 else ''} (training losses fed back, "
        "a scoring forward only for samples the memory does not know)"
        if age
        else "a scoring forward for every sample"
    )
    say(f"training the same MLP twice, {budget}: without and with sifting (beta={args.beta:g}; {scoring})")

    arms = [
        Arm("full (no sifting)"),
        Arm(
            f"sifted (beta={args.beta:g})",
            policy=lambda: sp.RelativeProbabilistic(beta=args.beta, history=2048),
            delay=args.worker_batch * 4,
            memory_age=age or None,
            observe=age > 0,
        ),
    ]
    results = []
    for arm in arms:
        audit = None
        if arm.policy is not None:
            # to the second and a random suffix: two demos started in one second get two runs
            run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
            audit = sp.AuditLog(audit_root, run_id=run_id)
        bar = progress_bar(
            total=None if args.budget_seconds else args.epochs * args.samples,
            unit="sample",
            desc=arm.name,
            disable=quiet,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        try:
            result = train_run(
                arm,
                written.urls,
                written.samples,
                test,
                epochs=args.epochs,
                budget_seconds=args.budget_seconds,
                storage_options=options,
                **train_options(args),
                seed=args.seed,
                evals=args.evals,
                audit=audit,
                progress=bar.update,
                flags={"hard": hard},
            )
        finally:
            bar.close()
        results.append(result)

    full, sifted = results
    plot = os.path.join(out, "accuracy.png")
    if can_plot:
        try:
            plot_runs(results, plot, title=f"siftpipe demo: {args.samples:,} samples, {budget}")
        except OSError as exc:
            # the results are printed all the same (found by review, 2026-12-05: lost to a
            # traceback after both runs had trained)
            can_plot = False
            print(
                f"siftpipe demo: no accuracy plot: cannot write {plot}: {exc.strerror or exc}",
                file=sys.stderr,
            )
    print()
    print(_table(results))
    print()
    print(verdict(full, sifted))
    share = sifted.stats.get("trained_hard", 0) / max(1, sifted.trained)
    print(
        f"The hard tail is {hard.mean():.0%} of the data and {share:.0%} of what the sifted run trained on "
        f"(keep rate {sifted.keep_rate:.2f})."
    )
    run_id = audit.run_id if audit is not None else "?"
    print(f"audit log of the sifted run: {audit_root} (run {run_id}); inspect it with")
    # --run: a root that earlier demos wrote to holds their runs too
    # (quoted: an --out with a space made the line fail when pasted; review, 2026-12-06)
    print(f"  siftpipe log summary {shlex.quote(audit_root)} --run {shlex.quote(run_id)}")
    if can_plot:
        print(f"plot of test accuracy against wall time: {plot}")
    say(f"(demo took {time.perf_counter() - wall0:.0f} s in all)")
    return 0
