"""Decisions for a run of losses: the policy per micro-batch, then NaN handling and warm-up.

Shared by the stage and by offline what-if replays of logged losses, so both decide alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._audit_io import REASONS
from .policies import Policy

__all__ = ["NAN", "POLICY", "PREDECODE", "REASONS", "WARMUP", "Decided", "decide_rows"]

POLICY, WARMUP, NAN, PREDECODE = 0, 1, 2, 3


@dataclass
class Decided:
    """Per-row arrays of one decided group (``weight``/``reason`` None mean all 1 / all policy)."""

    keep: np.ndarray
    prob: np.ndarray
    score: np.ndarray
    weight: np.ndarray | None
    reason: np.ndarray | None
    micro_batches: int
    nan: int
    warmup: int


def decide_rows(
    policy: Policy,
    rng: np.random.Generator,
    losses: np.ndarray,
    seq0: int,
    chunk: int,
    delay: int,
    nan_kept: bool,
    finite: np.ndarray | None = None,
    decided: tuple[np.ndarray, np.ndarray] | None = None,
) -> Decided:
    """Decide ``losses`` (rows ``seq0..``) in micro-batches of ``chunk`` rows.

    The policy sees each micro-batch's finite losses; non-finite ones are kept if ``nan_kept``
    (reason ``nan``); rows before ``delay`` with a finite loss are kept (reason ``warmup``).
    ``decided`` = (mask, keep probabilities) marks rows already kept upstream (before decode):
    they are kept with those probabilities, reason ``predecode``, and the policy never sees them.
    """
    rows = losses.shape[0]
    if finite is None:
        finite = np.isfinite(losses)
    upstream = decided[0] if decided is not None else None
    if upstream is not None:
        finite = finite & ~upstream
    all_finite = bool(finite.all())
    reason: np.ndarray | None = None
    nan = 0
    if all_finite and rows <= chunk:
        # the common case: one micro-batch, every loss finite; the policy's arrays are final
        d = policy.decide(losses, rng, seq0)
        keep, prob, score, weight = d.keep, d.prob, d.score, d.weight
        micro_batches = 1
    else:
        keep = np.zeros(rows, dtype=bool)
        prob = np.zeros(rows)
        score = np.full(rows, np.nan)
        weight = np.ones(rows)
        reason = np.zeros(rows, dtype=np.int8)
        micro_batches = 0
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            sub = np.arange(start, stop) if all_finite else finite[start:stop].nonzero()[0] + start
            if sub.size:
                d = policy.decide(losses[sub], rng, seq0 + start)
                keep[sub], prob[sub], score[sub] = d.keep, d.prob, d.score
                if d.weight is not None:
                    weight[sub] = d.weight
            micro_batches += 1
        if not all_finite:
            bad = ~finite if upstream is None else ~finite & ~upstream
            keep[bad] = nan_kept
            prob[bad] = float(nan_kept)
            reason[bad] = NAN
            nan = int(bad.sum())
        if upstream is not None:
            keep[upstream] = True
            prob[upstream] = decided[1][upstream]  # type: ignore[index]
            reason[upstream] = PREDECODE
    warmup = 0
    if seq0 < delay:
        warm = np.zeros(rows, dtype=bool)
        warm[: delay - seq0] = True
        warm &= finite
        keep = keep | warm
        prob = np.where(warm, 1.0, prob)
        if weight is not None:
            weight = np.where(warm, 1.0, weight)
        reason = np.where(warm, WARMUP, 0 if reason is None else reason).astype(np.int8)
        warmup = int(warm.sum())
    return Decided(keep, prob, score, weight, reason, micro_batches, nan, warmup)
