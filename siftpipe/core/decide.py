"""Decisions for a run of losses: the policy per micro-batch, then NaN handling and warm-up.

Shared by the stage and by offline what-if replays of logged losses, so both decide alike.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

from ..errors import PolicyError
from .policies import (
    Decision,
    InfoBatch,
    Policy,
    PruneEasy,
    RelativeProbabilistic,
    TopFraction,
    Uniform,
)
from .vocab import REASONS

__all__ = [
    "NAN",
    "POLICY",
    "PREDECODE",
    "REASONS",
    "UNKNOWN",
    "WARMUP",
    "Decided",
    "check_decision",
    "decide_rows",
]

POLICY, WARMUP, NAN, PREDECODE, UNKNOWN = 0, 1, 2, 3, 4

# siftpipe's own policies, exactly these classes (a subclass may override decide): their decisions
# are well formed for any finite losses (tests/core/test_properties.py), so the hot path skips the check
_CHECKED_BY_TESTS = frozenset({InfoBatch, PruneEasy, RelativeProbabilistic, TopFraction, Uniform})


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


_TAKES_POSITIONS: dict[type, bool] = {}


def _takes_positions(policy: Policy) -> bool:
    """Whether ``policy.decide`` takes ``positions=``: a positional policy's, unless a subclass
    overrode ``decide`` with the three-argument signature (it is given none)."""
    kind = type(policy)
    known = _TAKES_POSITIONS.get(kind)
    if known is None:
        known = kind.positional and "positions" in inspect.signature(kind.decide).parameters
        _TAKES_POSITIONS[kind] = known
    return known


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
    unknown: np.ndarray | None = None,
    *,
    all_finite: bool | None = None,
) -> Decided:
    """Decide ``losses`` (rows ``seq0..``) in micro-batches of ``chunk`` rows.

    The policy sees each micro-batch's finite losses; non-finite ones are kept if ``nan_kept``
    (reason ``nan``); rows before ``delay`` with a finite loss are kept (reason ``warmup``).
    ``decided`` = (mask, keep probabilities) marks rows already kept upstream (before decode):
    they are kept with those probabilities, reason ``predecode``, and the policy never sees them.
    ``unknown`` marks rows with no loss at all (a score memory that does not know them, with
    ``unknown="keep"``): kept with probability 1, reason ``unknown``, unseen by the policy.
    ``all_finite``: whether every entry of ``finite`` is True, if the caller knows.
    """
    rows = losses.shape[0]
    if finite is None:
        finite = np.isfinite(losses)
        all_finite = None
    upstream = decided[0] if decided is not None else None
    if upstream is not None:
        finite = finite & ~upstream
        all_finite = None
    if unknown is not None:
        finite = finite & ~unknown
        all_finite = None
    if all_finite is None:
        all_finite = np.count_nonzero(finite) == rows
    reason: np.ndarray | None = None
    nan = 0
    if all_finite and rows <= chunk:
        # the common case: one micro-batch, every loss finite; the policy's arrays are final
        d = policy.decide(losses, rng, seq0)
        if type(policy) not in _CHECKED_BY_TESTS:
            check_decision(policy, d, rows, seq0)
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
                if not all_finite and _takes_positions(policy):
                    # the rows the policy does not see lie between: it places each loss by its own
                    d = policy.decide(losses[sub], rng, seq0 + start, positions=seq0 + sub)  # type: ignore[call-arg]
                else:
                    d = policy.decide(losses[sub], rng, seq0 + start)
                if type(policy) not in _CHECKED_BY_TESTS:
                    check_decision(policy, d, sub.size, seq0 + start)
                keep[sub], prob[sub], score[sub] = d.keep, d.prob, d.score
                if d.weight is not None:
                    weight[sub] = d.weight
            micro_batches += 1
        if not all_finite:
            bad = ~finite if upstream is None else ~finite & ~upstream
            if unknown is not None:
                bad &= ~unknown
            keep[bad] = nan_kept
            prob[bad] = float(nan_kept)
            reason[bad] = NAN
            nan = int(np.count_nonzero(bad))
        if upstream is not None:
            keep[upstream] = True
            prob[upstream] = decided[1][upstream]  # type: ignore[index]
            reason[upstream] = PREDECODE
        if unknown is not None:
            keep[unknown] = True
            prob[unknown] = 1.0
            reason[unknown] = UNKNOWN
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
        warmup = int(np.count_nonzero(warm))
    return Decided(keep, prob, score, weight, reason, micro_batches, nan, warmup)


def check_decision(policy: Policy, d: Decision, n: int, seq: int) -> None:
    """Raise ``PolicyError`` unless ``d`` is a well-formed decision for ``n`` losses.

    A handful of vectorised reductions per micro-batch; the description of what is wrong is
    built only when something is."""
    if isinstance(d, Decision):
        keep, prob, score, weight = d.keep, d.prob, d.score, d.weight
        shape = (n,)
        if (
            isinstance(keep, np.ndarray)
            and keep.dtype == np.bool_
            and keep.shape == shape
            and isinstance(prob, np.ndarray)
            and prob.dtype.kind == "f"
            and prob.shape == shape
            and isinstance(score, np.ndarray)
            and score.dtype.kind in "fiu"
            and score.shape == shape
            # NaN fails both comparisons
            and np.minimum.reduce(prob) >= 0.0
            and np.maximum.reduce(prob) <= 1.0
            and (
                weight is None
                or (
                    isinstance(weight, np.ndarray)
                    and weight.dtype.kind == "f"
                    and weight.shape == shape
                    and np.minimum.reduce(weight) >= 0.0
                    and np.maximum.reduce(weight) < np.inf
                )
            )
        ):
            return
    raise PolicyError(
        f"policy {_name(policy)} returned a malformed decision for the micro-batch of {n} losses at "
        f"sample seq {seq}: {'; '.join(_problems(d, n))}. decide() must return a Decision of numpy "
        f"arrays of length {n}: keep (bool), prob (float keep probabilities in [0, 1]), score "
        "(numbers), weight (None, or finite floats >= 0)"
    )


def _name(policy: Policy) -> str:
    try:
        return repr(policy)
    except Exception:
        return type(policy).__name__


def _problems(d: object, n: int) -> list[str]:
    if not isinstance(d, Decision):
        return [f"it returned a {type(d).__name__}, not a siftpipe.Decision"]
    out = []
    for name, kinds, what in (
        ("keep", "b", "bool"),
        ("prob", "f", "float"),
        ("score", "fiu", "numeric"),
        ("weight", "f", "float"),
    ):
        value = getattr(d, name)
        if value is None and name == "weight":
            continue
        if not isinstance(value, np.ndarray):
            out.append(f"{name} is a {type(value).__name__}, not a numpy array")
            continue
        if value.dtype.kind not in kinds:
            out.append(f"{name} has dtype {value.dtype}, not {what}")
        if value.shape != (n,):
            out.append(f"{name} has shape {value.shape}, not ({n},)")
        if value.dtype.kind == "f" and value.shape == (n,) and name in ("prob", "weight"):
            bad = np.flatnonzero(
                ~((value >= 0) & (value <= 1)) if name == "prob" else ~((value >= 0) & np.isfinite(value))
            )
            if bad.size:
                rule = "in [0, 1]" if name == "prob" else "finite and >= 0"
                out.append(
                    f"{name} is not {rule} at {bad.size} row(s), e.g. row {int(bad[0])}: {value[bad[0]]!r}"
                )
    return out or ["it is malformed"]
