"""What the adversarial tests tried: counts summed over a pytest session and printed at its end.

A test calls ``tried("kills survived", n)`` (or another category) for each fault or bad input it
threw at siftpipe and survived as documented; ``conftest.py`` prints the totals in the terminal
summary and, when ``SIFTPIPE_TALLY`` names a file, writes them there as JSON, so that
docs/reliability.md can quote the figures of a real run.
"""

from __future__ import annotations

from collections import Counter

_counts: Counter[str] = Counter()


def tried(category: str, n: int = 1) -> None:
    """Count ``n`` more attempts of ``category`` (e.g. "kills survived", "bad inputs tried")."""
    if n < 0:
        raise ValueError(f"a count cannot be negative, got {n}")
    _counts[category] += n


def totals() -> dict[str, int]:
    """The counts so far, by category."""
    return dict(sorted(_counts.items()))
