"""What sifting costs and what it saves, in wall seconds: the stage's own evidence of whether it pays.

The stage is a generator, so it can see both sides of the bargain: the time it spends between being
asked for an item and handing one on (its own work, less the time its source took to produce
input, which is paid with or without sifting), and the time between handing an item on and being
asked for the next (the consumer's training step). The training time the dropped samples would have
cost is estimated from the second: samples dropped x step time per sample handed on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["CostAccount"]

_log = logging.getLogger("siftpipe")


class CostAccount:
    """Wall-clock counters of one stage in this process (not part of its state).

    ``inside``: seconds inside the stage's passes; ``source``: the part of it spent waiting for the
    source; ``outside``: seconds between handing an item on and being asked for the next;
    ``observe``: seconds in ``observe()`` (the consumer calls it, but it is the stage's cost);
    ``handed``: samples handed on; ``dropped``: samples dropped.
    """

    #: Seconds of evidence (the stage's and the steps' together) a pass needs before the stage
    #: judges from it whether sifting paid.
    MIN_EVIDENCE_SECONDS = 1.0

    __slots__ = (
        "_emitted",
        "_pass",
        "dropped",
        "handed",
        "inside",
        "mark",
        "observe",
        "outside",
        "source",
        "warned",
    )

    def __init__(self) -> None:
        self.inside = self.outside = self.source = self.observe = 0.0
        self.handed = self.dropped = 0
        self.mark = 0.0  # when the stage last resumed
        self._emitted = 0  # the ledger's count of samples handed on in the pass, when last read
        self._pass: tuple[float, float, int, int] = (0.0, 0.0, 0, 0)
        self.warned = False

    @property
    def stage_seconds(self) -> float:
        """Seconds of the stage's own work: scoring, deciding, re-batching, the audit hand-off and
        ``observe()``; not reading its source."""
        return max(0.0, self.inside - self.source) + self.observe

    @property
    def step_seconds(self) -> float:
        """Seconds the consumer spent between items, less ``observe()``: the training step."""
        return max(0.0, self.outside - self.observe)

    def saved_seconds(self) -> float:
        """Estimated training seconds the dropped samples would have cost (step time per sample
        handed on, times samples dropped; 0 before anything was handed on)."""
        return self.dropped * self.step_seconds / self.handed if self.handed else 0.0

    def through(self, items: Iterator[Any], emitted: Callable[[], int]) -> Iterator[Any]:
        """``items``, handed on with the time before each charged to the stage and the time after
        it to the consumer. ``emitted()``: samples handed on in this pass so far (the output's
        count, raised before each item is handed on)."""
        for item in items:
            now = time.perf_counter()
            self.inside += now - self.mark
            count = emitted()
            self.handed += count - self._emitted
            self._emitted = count
            yield item
            self.mark = time.perf_counter()
            self.outside += self.mark - now

    def pass_begins(self, emitted: int) -> None:
        """A pass starts (or resumes) with ``emitted`` samples handed on already: remember the
        counters, to judge this pass alone when it ends."""
        self.mark = time.perf_counter()
        self._emitted = emitted
        self._pass = (self.stage_seconds, self.step_seconds, self.handed, self.dropped)

    def pass_ends(self) -> None:
        """A pass ended: charge its last stretch to the stage and, once, log when the pass cost
        more in the stage than its dropped samples would have cost to train."""
        self.inside += time.perf_counter() - self.mark
        stage0, step0, handed0, dropped0 = self._pass
        stage, step = self.stage_seconds - stage0, self.step_seconds - step0
        handed, dropped = self.handed - handed0, self.dropped - dropped0
        if self.warned or not dropped or not handed or stage + step < self.MIN_EVIDENCE_SECONDS:
            return
        saved = dropped * step / handed
        if saved >= stage:
            return
        self.warned = True
        _log.warning(
            "siftpipe: sifting is not paying for itself: in the pass that just ended the stage spent "
            "%.2f s of its own (%.1f us a sample) and the %d samples it dropped would have cost about "
            "%.2f s to train (%.1f us a sample trained). On a training step this cheap, train on every "
            "sample, or sift only where a step costs more (a larger model or batch); stats.net_seconds "
            "has the figure for the whole run",
            stage,
            1e6 * stage / (handed + dropped),
            dropped,
            saved,
            1e6 * step / handed,
        )
