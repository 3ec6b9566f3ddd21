"""What the adversarial tests tried: counts summed over a pytest session and printed at its end.

A test calls ``tried("kills survived", n)`` (or another category) for each fault or bad input it
threw at siftpipe and survived as documented; ``conftest.py`` prints the totals in the terminal
summary and, when ``SIFTPIPE_TALLY`` names a file, writes them there as JSON, so that
docs/reliability.md can quote the figures of a real run. Tests of the tally itself count inside
``isolated()``, so that their made-up counts never reach the session's figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

#: The session's tally at the bottom; ``isolated()`` pushes a fresh one above it while it runs.
_stack: list[Counter[str]] = [Counter()]


def tried(category: str, n: int = 1) -> None:
    """Count ``n`` more attempts of ``category`` (e.g. "kills survived", "bad inputs tried")."""
    if n < 0:
        raise ValueError(f"a count cannot be negative, got {n}")
    _stack[-1][category] += n


def totals() -> dict[str, int]:
    """The counts so far, by category."""
    return dict(sorted(_stack[-1].items()))


@contextmanager
def isolated() -> Iterator[None]:
    """Count into a fresh, empty tally until the block ends, then put the session's back as it was:
    what was counted inside is forgotten (the tally's own tests use it)."""
    _stack.append(Counter())
    try:
        yield
    finally:
        _stack.pop()
