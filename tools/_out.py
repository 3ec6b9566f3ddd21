"""Output files of the benchmark tools: checked before a run, so that a path that cannot be
written fails at once, not after the run's measurements (found by review, 2026-12-05: a
26-minute bench_train run was lost to an --out in a missing folder)."""

from __future__ import annotations

import os


def check_writable(**paths: str) -> None:
    """Exit with a one-line message naming the flag if any of ``paths`` (flag name: path; empty:
    not asked for, '-': a standard stream) cannot be written: its folder missing or read-only,
    or the path a folder."""
    for flag, path in paths.items():
        if not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        problem = (
            "is a folder"
            if os.path.isdir(path)
            else f"cannot be written: its folder {folder} does not exist"
            if not os.path.isdir(folder)
            else f"cannot be written: its folder {folder} is not writable"
            if not os.access(folder, os.W_OK)
            else "cannot be written: it is not writable"
            if os.path.exists(path) and not os.access(path, os.W_OK)
            else None
        )
        if problem is not None:
            raise SystemExit(f"--{flag.replace('_', '-')} {path} {problem}")
