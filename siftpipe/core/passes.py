"""Passes, the stage's part: which pass is open, its source and reader, a loaded checkpoint waiting
to be re-read, and the stage's position in its passes as a checkpoint records it."""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import weakref
from collections.abc import Callable, Generator, Mapping
from types import FrameType
from typing import Any

import numpy as np
import torch

from ..errors import PassClosedError, ResumeError
from .ledger import Group, Ledger
from .resume import first_key, first_shard, shard_names
from .source import END, Raised, Reader
from .values import plain_keys

__all__ = ["POSITION", "Passes", "Superseded"]


class Superseded(BaseException):
    """Thrown into a running pass's iterator when the stage closes it (a new pass, a load,
    ``close()``): the pass cleans up, then raises ``PassClosedError`` if it is read again. A
    ``BaseException``, as ``GeneratorExit`` is, so that no ``except Exception`` on the way takes it."""


#: The state entries ``Passes.position`` gives and ``Passes.load`` reads.
POSITION = (
    "consumed",
    "read",
    "pending",
    "emitted",
    "epoch_set",
    "opened",
    "pass_read",
    "pass_open",
    "source",
    "next_key",
    "next_shard",  # optional when read, as steps
    "tail",  # optional when read, as steps
    "ended",
    "source_abandoned",
    "steps",  # optional when read: states written before it lack it
    "raised",  # optional when read, as steps
)


class Passes:
    """Where the stage is between and inside passes. The ``Sifter`` opens a pass with ``begin``,
    runs it between ``run_begins`` and ``run_ends``, and saves and loads its place with
    ``position`` and ``load``; ``ledger`` holds the pass's groups and positions."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        self.ledger = ledger if ledger is not None else Ledger()
        # a mid-pass checkpoint loaded by load_state_dict, until its pending groups are re-read
        self.restore: dict[str, Any] | None = None
        #: where in the open pass (items read before it) the source raised errors its caller was
        #: handed (SiftNode, ``surface``): a pass resumed from before them passes over them
        self.raised: list[int] = []
        self.open = False
        self.count = 0  # passes opened (a loaded checkpoint whose stage had opened one: 1)
        self.epoch_set = False  # set_epoch was called for the pass that reads next
        # the pass opened last has not read anything yet: calling again re-opens the same pass
        self.unstarted = False
        #: training steps a consumer (``EqualSteps``) counted in the open pass (``Sifter.pass_steps``)
        self.steps = 0
        #: ``steps`` when the open pass opened in this process (0, or a resumed pass's count)
        self.steps_opened = 0
        self.id = 0  # which call (or load) the running pass belongs to
        # a weak reference: a pass the caller abandons is freed at once (with what it holds:
        # DataLoader iterators and their workers), not kept alive by this stage or left to the
        # cyclic garbage collector
        self.active: weakref.ReferenceType[Generator[Any, None, None]] | None = None
        self.source: Any = None  # the running pass's source, when the stage tracks its state
        self.reader: weakref.ReferenceType[Reader] | None = None  # the running pass's reader
        self.source_restore: Any = None  # a between-passes checkpoint's source state, for the next call
        self.source_abandoned = False  # the tracked source's last pass was left before its end
        self.source_restored = False  # the pass opened last repositioned its source from a state
        self.closed_why = ""  # why the stage last closed a running pass (PassClosedError says)

    def __getstate__(self) -> dict[str, Any]:
        # a copy (pickle, deepcopy) holds no running pass: an iterator belongs to one process
        state = self.__dict__.copy()
        state["active"] = state["reader"] = None
        return state

    def close_active(self, why: str) -> None:
        """Close the running pass's iterator, if it is alive, for the reason ``why`` (what its
        consumer is told if it reads it again: ``PassClosedError``, not a quiet end of the epoch).

        The pass's clean-up runs now (its source's iterator is closed, its position given up);
        the iterator stays suspended, to raise when read. One that never started raises when
        read too (``Sifter._run`` checks that its pass is still the current one)."""
        gen = self.active() if self.active is not None else None
        if gen is None:
            return
        self.check_not_running(gen)
        self.active = None
        self.closed_why = why
        if inspect.getgeneratorstate(gen) != inspect.GEN_SUSPENDED:
            return  # ended, or never started (its body checks that it is current when it starts)
        with contextlib.suppress(StopIteration):  # (it yields once more: it never ends here)
            gen.throw(Superseded(why))

    def check_not_running(self, gen: Generator[Any, None, None] | None = None, doing: str = "") -> None:
        """``PassClosedError`` if the running pass's iterator is being read by another thread this
        moment: closing it there would fail there (a raw "generator already executing"), and a
        state taken now would hold a group half decided. ``doing``: what was refused, said."""
        if gen is None:
            gen = self.active() if self.active is not None else None
        if gen is not None and inspect.getgeneratorstate(gen) == inspect.GEN_RUNNING:
            if _on_this_stack(gen):
                raise PassClosedError(
                    "this Sifter was called back from inside its own running pass, in the thread "
                    "reading it (by its scorer, its policy, its audit sink or the source it "
                    "reads): it cannot open a pass, take its state or close while it decides a "
                    "group; call it between items (after next() returns)"
                )
            raise PassClosedError(
                "a pass of this Sifter is being read by another thread: a Sifter runs one pass "
                "at a time, read by one consumer; make one Sifter per pipeline (per thread), or "
                + (
                    doing
                    or "finish (or break out of) the running pass (a prefetching thread: stop it) "
                    "before opening the next or taking a batch back"
                )
            )

    def began_reading(self) -> None:
        """The pass iterated its source: whatever an earlier pass left mid-way is behind it."""
        self.source_abandoned = False

    def snapshot(self) -> Any:
        """The tracked source's state now (``None`` when it is not tracked)."""
        return self.source.state_dict() if self.source is not None else None

    def resume_from(self, track_source: bool | None) -> int | None:
        """The input item a resumed pass's untracked source must start at (``Sifter.resume_from``)."""
        restore = self.restore
        if restore is None or (restore.get("source") is not None and track_source is not False):
            return None
        if restore.get("noted"):
            return None  # closed unread (Sifter._leave_pass): the next call starts the next pass
        return int(restore["consumed"])

    def begin(
        self, source: Any, tracked: bool, track_source: bool | None
    ) -> tuple[dict[str, Any] | None, bool]:
        """Open a pass over ``source`` (``tracked``: the stage saves its state), repositioning a
        tracked source from the checkpoint. Returns the mid-pass checkpoint it resumes (or
        ``None``), and whether the epoch advances (a new pass after one that read, with no
        ``set_epoch`` in between)."""
        resume = self.restore
        # the tracked source's position: inside the checkpoint's pass, or where its last pass ended
        source_state = resume.get("source") if resume is not None else self.source_restore
        if source_state is not None and not tracked and track_source is not False:
            raise ResumeError(
                "the state holds the source's position (a stateful source was tracked), but "
                f"this source ({type(source).__name__}) has no load_state_dict; pass the same "
                "kind of source, or track_source=False and feed it from state['consumed']"
            )
        # (or a second SiftNode over this Sifter began its pass: found by review, 2026-12-05,
        # where the message blamed a call the user never made)
        self.close_active(
            "sifter(...) was called again, or a second SiftNode over this Sifter (one Sifter in two "
            "SiftNodes: give each node its own, over the same model) began its pass, which opened "
            "a new pass"
        )
        # `resume` stays until the pass has re-read the pending groups, so that a state taken
        # before the first next() (or a call that is dropped unstarted) still holds them
        advance = False
        if resume is None:
            advance = self.count > 0 and not self.epoch_set and not self.unstarted
            self.ledger.drop_pending(consumed=0)  # positions count from the start of each pass
        self.unstarted = resume is None
        self.steps = self.steps_opened = 0 if resume is None else int(resume.get("steps", 0))
        self.raised = [] if resume is None else [int(p) for p in resume.get("raised", ())]
        self.count += 1
        self.id += 1
        self.open = True
        #: whether this pass's source was repositioned from a state (which says its epoch)
        self.source_restored = source_state is not None and tracked
        if self.source_restored:
            # a copy: a source may keep the dict it is given and change it as it reads
            # (torchdata's MultiNodeWeightedSampler marks datasets exhausted in it), which is the
            # stage's own saved state (found by review, 2026-12-06: a job resumed twice skipped a
            # dataset, a sample lost or a ResumeError saying the source had changed)
            source.load_state_dict(copy.deepcopy(source_state))
            if self.source_abandoned:
                # the checkpoint's source was left mid-way through a pass: in its process the
                # next iteration started a new one, and so does iterating the restored one once
                # (the flag stays until this pass reads: a state taken before then needs it too)
                iter(source)
        self.source_restore = None
        self.source = source if tracked else None
        return resume, advance

    def attach(self, gen: Generator[Any, None, None], reader: Reader) -> None:
        """The opened pass's iterator and reader (weakly held)."""
        self.active = weakref.ref(gen)
        self.reader = weakref.ref(reader)

    def run_begins(self, resume: Mapping[str, Any] | None) -> int:
        """The pass starts running (its pending groups re-read): returns its id for ``run_ends``."""
        self.restore = None
        self.unstarted = False
        if resume is None or not resume.get("pass_read", True):
            # a set_epoch counts for the pass that reads next: this one, unless it is a pass
            # resumed mid-way (then the set_epoch came during it, and counts for the next)
            self.epoch_set = False
        return self.id

    def is_current(self, pass_id: int) -> bool:
        """No newer pass was opened, nor a checkpoint loaded, since pass ``pass_id`` began."""
        return self.id == pass_id

    def run_ends(self, pass_id: int, finished: bool, reader: Reader) -> None:
        """Pass ``pass_id`` ended (``finished``), or was abandoned or failed: the next call starts a
        new pass, unless a newer pass or a load came first (a pass left in a reference cycle is
        closed whenever the garbage collector gets to it)."""
        if self.id != pass_id:
            return
        self.open = False
        # what was fully handed on before it ended (a pass that failed hands on its waiting
        # rows first): consumed stands after it (the group that failed is not pending)
        self.ledger.trim()
        self.ledger.drop_pending()
        # left before the source's end: a restored source must be moved past that pass
        self.source_abandoned = not finished and self.source is not None and reader.ahead is not END

    def position(
        self,
        keys: Callable[[Group], list[Any] | None],
        batched: bool,
        key: Any,
        held_rows: int = 0,
        held_steps: int = 0,
    ) -> dict[str, Any]:
        """The ``POSITION`` entries of the stage's state (``keys``: a group's sample keys; ``batched``
        and ``key`` find the key of the item read ahead; ``held_rows``: the last rows handed on
        that the state takes back, resuming before them: ``Sifter.state_dict(held=)``)."""
        ledger = self.ledger
        ledger.trim()
        restore = self.restore
        # errors passed over at the position the state resumes from, after the source's state
        # it restores was taken: met again there (a resumed pass's; found by review, 2026-12-05)
        at_start: tuple[int, ...] = ()
        if restore is not None:
            # loaded and not re-read yet: the checkpoint's position is still the position
            pending = [
                {**desc, "keep": desc["keep"].clone(), "weight": _clone(desc["weight"])}
                for desc in restore["pending"]
            ]
            consumed, emitted = int(restore["consumed"]), int(restore["emitted"])
            at_start = tuple(int(p) for p in restore.get("raised", ()) if int(p) == consumed)
            source_state = restore["source"]
            next_key, ended = restore.get("next_key"), bool(restore.get("ended", False))
            next_shard = restore.get("next_shard")
            tail = restore.get("tail")
            source_abandoned = bool(restore.get("source_abandoned", False))
            pass_read = bool(restore.get("pass_read", True))
        else:
            groups = list(ledger.pending)
            consumed, emitted = ledger.consumed, ledger.emitted
            finished = list(ledger.tail) if ledger.tail is not None else None
            if held_rows:
                # resume before the last rows handed on: the groups trim forgot that hold them
                # are pending again (Sifter.state_dict(held=); never with a restore pending)
                back = ledger.held_back(held_rows)
                groups = back + groups
                consumed -= sum(g.n_items for g in back)
                emitted += sum(g.n_kept for g in back) - held_rows
                if finished is not None:
                    finished = finished[: max(0, len(finished) - sum(g.n_items for g in back))]
            tail = self._tail(finished)
            pass_read = not (self.open and self.unstarted)  # False only for an open, unread pass
            # set from a pass left mid-way until the next pass starts reading the source
            source_abandoned = self.source_abandoned
            pending = [
                {
                    "n_items": g.n_items,
                    "rows": g.rows,
                    "seq0": g.seq0,
                    "keep": torch.from_numpy(g.keep.copy()),
                    # float64, as handed on: a float32 copy made resumed weights differ in the last bits
                    "weight": None if g.weight is None else torch.from_numpy(g.weight.astype(np.float64)),
                    "keys": plain_keys(keys(g)),
                    # the shards they came from: keys that shards number alike match elsewhere
                    "shards": shard_names(g, batched),
                }
                for g in groups
            ]
            source_state = self.source_restore
            next_key, next_shard, ended = None, None, False
            reader = self.reader() if self.reader is not None and self.open else None
            if reader is not None and reader.it is None:
                reader = None  # not read yet: reading ahead would start the source's pass
            if groups:
                at_start = groups[0].skipped
                if self.source is not None:
                    source_state = groups[0].snapshot
            elif reader is not None:
                # nothing pending: read the next item now, so that a resumed source fed from the
                # wrong position is caught at once (its keys are checked against this one's)
                ahead = reader.look_ahead(self.snapshot())
                if ahead is END:
                    # the source's state after its end: a resumed pass does not read it again
                    # (that would start its next pass), and the next pass starts from there
                    ended = True
                    source_state = self.snapshot() if self.source is not None else source_state
                else:
                    at_start = tuple(reader.skipped)  # passed over since the look-ahead's state
                    if self.source is not None:
                        source_state = reader.ahead_snapshot
                    if not isinstance(ahead, Raised):
                        next_key = plain_keys([first_key(ahead, batched, key)])[0]
                        next_shard = first_shard(ahead, batched)
            elif self.source is not None:
                source_state = self.snapshot()
        return {
            "consumed": consumed,
            "read": consumed + sum(int(d["n_items"]) for d in pending),
            "pending": pending,
            "emitted": emitted,
            "epoch_set": self.epoch_set,
            "opened": self.count > 0,
            "pass_read": pass_read,
            "pass_open": self.open,
            "source": source_state,
            "next_key": next_key,
            "next_shard": next_shard,
            # the last input items the position has finished, each as [key, shard]: where a
            # resume skips them by count (webdataset's .sift()), it compares them (None: not kept)
            "tail": tail,
            "ended": ended,
            "source_abandoned": source_abandoned,
            # states written before it lack it: a consumer then counts from 0 (as it did)
            # (less the steps the consumer counted for the held batches it never trained)
            "steps": int(restore.get("steps", 0))
            if restore is not None
            else self.steps - held_steps
            if self.open
            else 0,
            # errors handed on after the position it resumes from: met again there, passed over
            # (found by review, 2026-12-05: raised a second time after a resume)
            "raised": [p for p in at_start if p == consumed]
            + [p for p in self._raised(restore) if p > consumed],
        }

    @staticmethod
    def _tail(finished: list[tuple[Any, str | None]] | None) -> list[list[Any]] | None:
        """The state's ``tail``: ``finished`` (the ledger's tail) as [key, shard] pairs in forms
        ``torch.load(weights_only=True)`` reads, or None where they say nothing."""
        if not finished or all(k is None and s is None for k, s in finished):
            return None
        keys = plain_keys([k for k, _ in finished])
        return [[k, s] for k, (_, s) in zip(keys, finished, strict=True)]

    def _raised(self, restore: Mapping[str, Any] | None) -> list[int]:
        """Where the errors handed on stand: the loaded checkpoint's, or the open pass's."""
        if restore is not None:
            return [int(p) for p in restore.get("raised", ())]
        return self.raised if self.open else []

    def raised_at(self, position: int) -> None:
        """The open pass handed its caller an error the source raised after ``position`` items."""
        raised = self.raised
        raised.append(position)
        if len(raised) > _RAISED_KEPT:
            # (no resume goes back further than the last groups: see Ledger.held_back)
            del raised[: len(raised) - _RAISED_KEPT]

    def load(self, state: Mapping[str, Any], forget_keys: bool) -> None:
        """Take the checkpoint's position (checked already). ``forget_keys``: its keys were read
        with another ``key`` setting, so re-read samples are not compared by key. The stage
        closed the running pass first."""
        self.ledger.drop_pending(consumed=int(state["consumed"]))
        self.epoch_set = bool(state.get("epoch_set", False))
        self.unstarted = False
        # a stage that never opened a pass starts its first in epoch 0 (version 1 did not say)
        self.count = int(bool(state.get("opened", True)))
        self.id += 1
        self.source = None
        self.source_abandoned = bool(state.get("source_abandoned", False))
        self.steps = self.steps_opened = int(state.get("steps", 0)) if state["pass_open"] else 0
        if state["pass_open"]:
            self.restore = dict(state)
            if forget_keys:
                self.restore["pending"] = [{**desc, "keys": None} for desc in state["pending"]]
                self.restore["next_key"] = None
                tail = state.get("tail")
                self.restore["tail"] = None if tail is None else [[None, shard] for _, shard in tail]
            self.source_restore = None
            self.open = True
        else:
            # the checkpoint fell between passes: the next call starts the next one, from where
            # the tracked source's last pass left it (a StatefulDataLoader: its next epoch's order)
            self.restore = None
            self.source_restore = state["source"]
            self.open = False


#: The most errors a pass remembers having handed on (the latest; a checkpoint holds those after
#: its position only)
_RAISED_KEPT = 4096


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _on_this_stack(gen: Generator[Any, None, None]) -> bool:
    """Whether the running generator ``gen`` runs in this thread, below the caller (the caller
    was called back from inside it), not in another thread."""
    frame = getattr(gen, "gi_frame", None)
    here: FrameType | None = sys._getframe(1)
    while here is not None:
        if here is frame:
            return True
        here = here.f_back
    return False
