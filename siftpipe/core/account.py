"""What sifting costs and what it saves, in wall seconds: the stage's own evidence of whether it pays.

The stage is a generator, so it can see both sides of the bargain: the time it spends between being
asked for an item and handing one on (its own work, less the time its source took to produce
input, which is paid with or without sifting), and the time between handing an item on and being
asked for the next (the consumer's training step). The training time the dropped samples would have
cost is estimated from the second: samples dropped x step time per sample handed on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .source import END

if TYPE_CHECKING:
    from .ledger import Output

__all__ = ["CostAccount"]

_log = logging.getLogger("siftpipe")

#: Guards ``CostAccount.off_begins``/``off_ends`` (blocks open in several threads; one lock for
#: every account, so that an account stays picklable)
_OFF_LOCK = threading.Lock()


class CostAccount:
    """Wall-clock counters of one stage over its run (kept in its state, so that a job restarted
    from checkpoints is judged on its whole run).

    ``inside``: seconds inside the stage's passes; ``source``: the part of it spent waiting for the
    source; ``outside``: seconds between handing an item on and being asked for the next, less
    what the consumer spent off the clock (``off_clock``);
    ``observe``: seconds in ``observe()`` (the consumer calls it, but it is the stage's cost);
    ``handed``: samples handed on; ``dropped``: samples dropped.
    """

    #: Seconds of evidence (the stage's and the steps' together) a pass needs before the stage
    #: judges from it whether sifting paid.
    MIN_EVIDENCE_SECONDS = 1.0

    __slots__ = (
        "_away",
        "_emitted",
        "_handing",
        "_moved",
        "_off_depth",
        "_off_since",
        "_pass",
        "dropped",
        "dropping_passes",
        "handed",
        "inside",
        "observe",
        "outside",
        "source",
        "warned",
    )

    def __init__(self) -> None:
        self.inside = self.outside = self.source = self.observe = 0.0
        self.handed = self.dropped = 0
        self._emitted = 0  # the pass output's count of samples handed on, when last added
        self._moved = 0.0  # seconds timed inside that were the step's (to_step), not yet added
        self._handing = False  # the consumer holds the pass's items: its time is its step's
        self._away = 0.0  # seconds of it the consumer spent off the clock (``off_clock``)
        self._off_depth = 0  # off_clock blocks open (nested, or in several threads)
        self._off_since = 0.0  # when the outermost opened
        self._pass = 0  # samples dropped before the running pass
        self.dropping_passes = 0
        self.warned = False

    def __getstate__(self) -> dict[str, Any]:
        # a copy (pickled, deep-copied) made inside an off_clock block has no block of its own
        # open: the block's end closes the original's, and the copy's depth would never return to
        # 0, so none of its later blocks would be left out (found 2026-12-06)
        with _OFF_LOCK:
            state = {name: getattr(self, name) for name in self.__slots__}
        state["_off_depth"] = 0
        return state

    def __setstate__(self, state: Mapping[str, Any] | tuple[Any, Mapping[str, Any] | None]) -> None:
        if isinstance(state, tuple):  # pickled before 2026-12-06: (None, the slots' values)
            state = {**(state[1] or {}), "_off_depth": 0}
        for name, value in state.items():
            setattr(self, name, value)

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

    #: The counters a state holds: seconds (floats), samples and passes (ints), and the flag.
    SECONDS = ("inside", "outside", "source", "observe")
    COUNTS = ("handed", "dropped", "dropping_passes")

    def state_dict(self) -> dict[str, Any]:
        return {
            **{name: float(getattr(self, name)) for name in self.SECONDS},
            **{name: int(getattr(self, name)) for name in self.COUNTS},
            "warned": bool(self.warned),
            # samples dropped before the running pass: a pass resumed from here counts as one
            # that dropped samples if it did before the cut too (found by review, 2026-12-05:
            # a cut after a pass's last decision hid its drops, and the guard judged a pass late)
            "pass_dropped": int(self._pass),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()`` (checked by the stage's ``check_state``)."""
        for name in self.SECONDS:
            setattr(self, name, float(state[name]))
        for name in self.COUNTS:
            setattr(self, name, int(state[name]))
        self.warned = bool(state["warned"])
        # (states written before 2026-12-05 lack it: the pass counts from the resume, as then)
        self._pass = int(state.get("pass_dropped", self.dropped))

    def to_step(self, seconds: float) -> None:
        """``seconds`` of the time being timed inside the stage were the consumer's step's: the
        stage waited for the step's losses to arrive from the device (``HostCopy``), which a run
        without sifting spends too. Moved at the next ``add`` (or the pass's end)."""
        self._moved += seconds

    def off_clock(self, seconds: float) -> None:
        """``seconds`` the consumer spent, between two items of a pass, on work that is not its
        training step (an evaluation, a checkpoint): left out of ``outside``, so that the step
        time per sample (and so ``saved_seconds``) is the step's. Ignored outside a pass's hand
        on (between passes nothing is timed)."""
        if self._handing and seconds > 0:
            self._away += seconds

    def off_begins(self) -> None:
        """An ``off_clock`` block opens; blocks nested or overlapping (in several threads) count
        once, from the first's start to the last's end (the review of the change: a nested
        block was left out twice, and the step time of its group came out 0)."""
        with _OFF_LOCK:
            self._off_depth += 1
            if self._off_depth == 1:
                self._off_since = time.perf_counter()

    def off_ends(self) -> None:
        """An ``off_clock`` block closes (see ``off_begins``)."""
        with _OFF_LOCK:
            if self._off_depth <= 0:
                return  # (none open: nothing to leave out)
            self._off_depth -= 1
            if self._off_depth == 0:
                self.off_clock(time.perf_counter() - self._off_since)

    def add(self, inside: float, outside: float, handed: int) -> None:
        """Add seconds ``inside`` the stage and ``outside`` it; ``handed``: samples the pass's
        output has handed on so far."""
        moved, self._moved = self._moved, 0.0
        self.inside += inside - moved
        self.outside += outside + moved
        self.handed += handed - self._emitted
        self._emitted = handed

    def timed(self, groups: Iterator[Iterator[Any]], out: Output) -> Generator[Any, None, float]:
        """Hand on the items of ``groups`` (``out``'s, group by group), timing both sides: the time
        before a group's first item is handed on is the stage's (reading past its source,
        deciding, taking rows), the time from then to the group's end the consumer's (its steps),
        less the output batches built in between (``out.busy``: re-batching, ``collate_fn``, the
        stage's work too). The stage's other work between items is a few list operations: no
        clock read per item. Returns the clock when the last group was handed on (for
        ``pass_ends``); whatever stops it, the time so far is added."""
        clock = time.perf_counter
        mark = clock()
        inside = outside = 0.0
        try:
            for items in groups:
                first = next(items, END)
                if first is END:
                    continue  # nothing kept: its time goes with the next group that hands on
                handed_at, busy = clock(), out.busy
                inside += handed_at - mark
                self._away, self._handing = 0.0, True
                yield first
                yield from items
                mark = clock()
                self._handing = False
                busy = out.busy - busy
                inside += busy
                # time the consumer said was not its step (off_clock) is nobody's: an
                # evaluation between steps inflated the step time, and so what sifting saved
                # (found by review, 2026-12-06)
                outside += max(0.0, mark - handed_at - busy - self._away)
                self.add(inside, outside, out.handed)
                inside = outside = 0.0
            return mark
        finally:
            self._handing = False
            self.add(inside, outside, out.handed)

    def pass_begins(self, resumed: bool = False) -> None:
        """A pass starts, or resumes (``resumed``: from a loaded state, which says what the pass
        had dropped before the cut)."""
        self._emitted = 0
        if not resumed:
            self._pass = self.dropped

    def pass_ends(self, mark: float | None, stopping: bool = False) -> bool:
        """A pass ended: charge its last stretch (since ``mark``, a ``time.perf_counter()``; None
        for a pass left early) to the stage and judge the run so far (``judge``); True if it
        found, for the first time, that sifting is not paying. ``stopping``: the stage stops
        sifting if so (said in the log)."""
        if mark is not None:
            self.inside += time.perf_counter() - mark
        moved, self._moved = self._moved, 0.0
        self.inside -= moved
        self.outside += moved
        if self.dropped > self._pass:
            self.dropping_passes += 1
            return self.judge(stopping)
        return False

    def epoch_ends(self, stopping: bool = False) -> bool:
        """One endless pass moved on to another epoch (``set_epoch`` inside it): judge the run so
        far as at a pass's end, an epoch that dropped samples counting as a pass that did; the
        time is charged as it goes. True if it found, for the first time, that sifting is not
        paying."""
        if self.dropped > self._pass:
            self._pass = self.dropped  # the pass's end counts what it drops from here on
            self.dropping_passes += 1
            return self.judge(stopping)
        return False

    #: Passes that dropped samples before the stage judges whether it pays: a first pass that only
    #: learns losses (``siftpipe.recipe``'s) is a debt the next ones pay back.
    JUDGE_AFTER = 2

    def judge(self, stopping: bool = False) -> bool:
        """Log once when, over the run so far, the stage's own time exceeds the training time its
        dropped samples would have cost (with enough evidence: ``JUDGE_AFTER`` passes that
        dropped samples, ``MIN_EVIDENCE_SECONDS`` of time); True when it logs."""
        stage, step, handed, dropped = self.stage_seconds, self.step_seconds, self.handed, self.dropped
        if (
            self.warned
            or self.dropping_passes < self.JUDGE_AFTER
            or not handed
            or stage + step < self.MIN_EVIDENCE_SECONDS
        ):
            return False
        saved = self.saved_seconds()
        if saved >= stage:
            return False
        self.warned = True
        seen = handed + dropped
        per_seen, per_step = stage / seen, step / handed
        _log.warning(
            "siftpipe: sifting is not paying for itself: so far the stage spent %.2f s of its own "
            "(%.1f us a sample it saw) and the %d samples it dropped (%.0f%% of those it saw) would "
            "have cost about %.2f s to train (%.1f us a sample trained); %s. Train on every sample, "
            "or sift where a step costs more (a larger model or batch) or more can be dropped; "
            "stats.net_seconds follows the figure.%s",
            stage,
            1e6 * per_seen,
            dropped,
            100.0 * dropped / seen,
            saved,
            1e6 * per_step,
            f"at this cost it pays only when it drops more than {100.0 * per_seen / per_step:.0f}%"
            if per_step > 0 and per_seen < per_step
            else "at this cost it cannot pay at any share dropped",
            " Sifting stops here for the rest of the run (cost_guard): every sample is kept from now on"
            if stopping
            else "",
        )
        return True
