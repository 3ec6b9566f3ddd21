"""The ledger of the stage's position in a pass: groups decided and not yet all handed on
(pending), input items finished (consumed), kept rows of the first pending group already handed
on (emitted); and the output that hands kept rows on and moves the ledger forward."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import SiftError
from . import batch as _batch
from .scoring import Scoring

__all__ = ["TAIL", "Group", "Ledger", "Output"]

#: How many of the last input items finished a state names where a resume skips by count (one
#: per DataLoader worker whose items interleave there, up to this many)
TAIL = 16

_NO_ROWS = np.zeros(0, dtype=bool)
_NO_INDEX = np.zeros(0, dtype=np.int64)


class Group:
    """The input items of one decided micro-batch (per-sample mode) or one input batch."""

    __slots__ = (
        "items",
        "keep",
        "kept_index",
        "key_column",
        "keys",
        "n_items",
        "rows",
        "seq0",
        "skip",
        "skipped",
        "snapshot",
        "tail",
        "unknown",
        "upstream",
        "weight",
    )

    def __init__(self, items: list[Any], rows: int, seq0: int, snapshot: Any) -> None:
        self.items = items
        self.n_items = len(items)
        self.rows = rows
        self.seq0 = seq0
        self.snapshot = snapshot
        self.keep: np.ndarray = _NO_ROWS
        self.weight: np.ndarray | None = None
        self.kept_index: np.ndarray = _NO_INDEX
        self.skip = 0  # kept rows handed on before the checkpoint this group was re-read from
        # where errors a resumed pass passed over (already handed on) stood, read after this
        # group's snapshot was taken: restored to it, the source meets them again
        self.skipped: tuple[int, ...] = ()
        self.upstream: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.unknown: np.ndarray | None = None  # rows with no loss (unknown="keep")
        #: The rows' keys as read, before any row was handed on (a later stage may change a
        #: sample in place): kept once computed (``Decider.keys``, ``note_tail``)
        self.keys: list[Any] | None = None
        #: A copy of a batch's key column as read (batched mode; ``note_keys``): what
        #: ``Decider.keys`` reads when it has not read the keys yet
        self.key_column: Any = None
        #: (key, shard) of the group's last input items as read, where the ledger keeps a tail
        self.tail: list[tuple[Any, str | None]] = []

    @property
    def n_kept(self) -> int:
        return int(self.kept_index.size)


class Ledger:
    """Where the stage stands in a pass. ``consumed`` is always a group boundary: a resumed stage
    feeds its source from there and re-reads the pending groups (docs/design.md)."""

    def __init__(self) -> None:
        self.pending: deque[Group] = deque()
        self.consumed = 0
        self.emitted = 0
        #: Groups ``trim`` forgot, kept while their kept rows and ``emitted`` cover ``keep_rows``
        #: (the rows of the last ``Sifter.hold`` batches handed on: ``state_dict(held=)``)
        self.behind: deque[Group] = deque()
        self.behind_rows = 0
        self.keep_rows = 0
        #: The last pending group's read ended in a source error not yet handed on: ``trim``
        #: keeps the group, so that a state taken until the error is handed on resumes before the
        #: failing item (the source's state after it is past it: found by review, 2026-12-05, an
        #: error lost by a checkpoint taken between the last sample before it and the error)
        self.error_held = False
        #: (key, shard) of the last input items this pass finished (up to ``TAIL``), recorded
        #: only where a resume skips the items a checkpoint finished by their count
        #: (``record_tail``), as each group was read (``Group.tail``)
        self.tail: deque[tuple[Any, str | None]] | None = None

    def record_tail(self) -> None:
        """Keep (key, shard) of the last ``TAIL`` input items finished, so that a state can name
        them (``Passes.position``); each group notes its own as it is read (``note_tail``)."""
        self.tail = deque(maxlen=TAIL)

    def drop_pending(self, consumed: int | None = None) -> None:
        """Forget the pending groups (a pass ended or failed, or a state is loaded); ``consumed``:
        the position to stand at, if it moves too."""
        self.pending.clear()
        self.emitted = 0
        self.error_held = False
        self.behind.clear()
        self.behind_rows = self.keep_rows = 0
        if self.tail is not None:
            self.tail.clear()
        if consumed is not None:
            self.consumed = consumed

    def trim(self) -> None:
        """Forget leading groups whose kept samples have all been handed on."""
        pending = self.pending
        while pending and pending[0].n_kept <= self.emitted:
            if self.error_held and len(pending) == 1:
                break
            group = pending.popleft()
            self.emitted -= group.n_kept
            self.consumed += group.n_items
            if self.tail is not None:
                self.tail.extend(group.tail)
            if self.keep_rows:
                self.behind.append(group)
                self.behind_rows += group.n_kept
        behind = self.behind
        while behind and self.behind_rows - behind[0].n_kept + self.emitted >= self.keep_rows:
            self.behind_rows -= behind.popleft().n_kept

    def finished(self, entries: Iterable[tuple[Any, str | None]]) -> None:
        """Note input items finished, as (key, shard) (the items a resume skipped)."""
        if self.tail is not None:
            self.tail.extend(entries)

    def held_back(self, rows: int) -> list[Group]:
        """The groups ``trim`` forgot that hold the last ``rows`` rows handed on beyond the
        pending groups' ``emitted`` (in order), or ``SiftError`` if it no longer keeps them."""
        need = rows - self.emitted
        out: list[Group] = []
        for group in reversed(self.behind):
            if need <= 0:
                break
            out.append(group)
            need -= group.n_kept
        if need > 0:
            raise SiftError(
                f"the stage no longer keeps the samples of the last {rows} rows handed on (it keeps "
                "those of the last Sifter(hold=...) batches): nothing was written"
            )
        out.reverse()
        return out

    def seq_at(self, pos: int) -> int:
        """The seq of kept row ``pos`` of the pending groups (in the order they are handed on;
        ``emitted`` is the first not yet handed), or -1 if they hold fewer rows."""
        return kept_seq(self.pending, pos)


def kept_seq(groups: Iterable[Group], pos: int) -> int:
    """The seq of kept row ``pos`` of ``groups`` (in the order they are handed on), or -1 if
    they hold fewer rows."""
    for group in groups:
        index = group.kept_index
        if pos < index.size:
            return group.seq0 + int(index[pos])
        pos -= index.size
    return -1


def restored_groups(restore: Mapping[str, Any]) -> list[Group]:
    """The pending groups of a loaded checkpoint (``restore["pending"]``) as ``Group``s holding
    only their decisions (rows, first seq, keep mask): enough to count and name the kept rows
    its run had not handed on (``Sifter._give_up_loaded_pass``, ``_leave_pass``,
    ``_handed_until``), not to hand them on."""
    groups = []
    for desc in restore["pending"]:
        group = Group([], int(desc["rows"]), int(desc["seq0"]), None)
        group.keep = desc["keep"].numpy().astype(bool)
        group.kept_index = np.flatnonzero(group.keep)
        groups.append(group)
    return groups


#: Batches handed on whose rows ``Sifter.discard_last`` can still find: the batch a consumer
#: discards and the ones something between it and the stage (a prefetcher) fetched after it
RECENT_BATCHES = 64


class Output:
    """Hands kept samples on: one by one, as filtered batches, or as fixed-size batches."""

    def __init__(
        self,
        ledger: Ledger,
        scoring: Scoring,
        output_batch: int | None,
        resumed: bool = False,
        hold: int = 0,
    ) -> None:
        self.ledger = ledger
        self.scoring = scoring  # its batched and collate_fn (which a trainer integration may swap)
        self.output_batch = output_batch
        self.buffer: list[Any] = []
        self.buffered = 0
        self.handed = 0  # samples handed on by this output (the ledger's emitted count is trimmed)
        self.busy = 0.0  # seconds spent building output batches (the stage's work, for its account)
        self.resumed = resumed  # the pass resumed from a state (what it handed on before is not here)
        #: Batches handed on in this pass (by this process: a resumed pass counts from 0), and the
        #: last ``RECENT_BATCHES`` of them as (rows, first seq, last seq), for
        #: ``Sifter.discard_last``; ``pass_id``: the pass's (``Passes.run_begins``)
        self.batches = 0
        self.recent: deque[tuple[int, int, int]] = deque(maxlen=RECENT_BATCHES)
        self.pass_id = -1
        self.hold = hold  # Sifter.hold: the ledger keeps the groups of this many batches

    def hand_on(self, group: Group) -> Iterator[Any]:
        s, ledger = self.scoring, self.ledger
        index = group.kept_index[group.skip :] if group.skip else group.kept_index
        if s.batched:
            if index.size == 0:
                ledger.trim()
                return
            batch = group.items[0]
            kept = _batch.take(batch, index) if index.size < group.rows else batch
            if self.output_batch is None:
                self._hand(index.size, group.seq0 + int(index[0]), group.seq0 + int(index[-1]))
                yield kept
                ledger.trim()
                return
            self.buffer.append(kept)
            self.buffered += index.size
            yield from self._full_batches()
            if kept is batch and self.buffer:
                # the rows held for the next output batch wait across the source's next read,
                # and a source may reuse the memory of the batch it handed (a staging ring, FFCV,
                # DALI): held, they are the stage's own copy (found by review, 2026-12-05: rows of
                # a fully kept batch held over were overwritten, handed on twice, others never)
                held = self.buffer[-1]
                self.buffer[-1] = _batch.take(held, np.arange(_batch.batch_size(held), dtype=np.int64))
            return
        items = group.items
        if self.output_batch is None:
            for i in index.tolist():
                ledger.emitted += 1
                self.handed += 1
                yield items[i]
            ledger.trim()
            return
        self.buffer.extend(items[i] for i in index.tolist())
        self.buffered = len(self.buffer)
        yield from self._full_batches()

    def _full_batches(self) -> Iterator[Any]:
        s, ledger = self.scoring, self.ledger
        size = self.output_batch
        assert size is not None
        while self.buffered >= size:
            t0 = time.perf_counter()
            if s.batched:
                whole = _batch.concat(self.buffer)
                rest = self.buffered - size
                if rest:
                    # slices: the batch handed on and the rest share the concatenation's memory
                    out, tail = _batch.split(whole, size)
                    self.buffer = [tail]
                else:
                    out, self.buffer = whole, []
                self.buffered = rest
            else:
                out = s.collate_fn(self.buffer[:size])
                del self.buffer[:size]
                self.buffered = len(self.buffer)
            self.busy += time.perf_counter() - t0
            self._hand(size)
            yield out
            ledger.trim()
        ledger.trim()

    def _hand(self, rows: int, first: int = -1, last: int = -1) -> None:
        """A batch of ``rows`` kept rows (seqs ``first`` to ``last``: looked up when not given) is
        about to be handed on: count it, and remember it for ``Sifter.discard_last``."""
        ledger = self.ledger
        if first < 0:
            first = ledger.seq_at(ledger.emitted)
            last = ledger.seq_at(ledger.emitted + rows - 1)
        ledger.emitted += rows
        self.handed += rows
        self.batches += 1
        self.recent.append((rows, first, last))
        if self.hold:
            ledger.keep_rows = sum(rows for rows, _, _ in self.last(self.hold))

    def last(self, count: int) -> list[tuple[int, int, int]]:
        """The last ``count`` batches handed on (at most ``RECENT_BATCHES``), oldest first, as
        (rows, first seq, last seq)."""
        recent = self.recent
        return list(itertools.islice(recent, max(0, len(recent) - count), None))

    def drop(self) -> None:
        """Forget the rows waiting for a full batch (``drop_last``): the ledger counts them as
        handed on, so the pass ends at a group boundary; the stage has noted them unhanded."""
        self.ledger.emitted += self.buffered
        self.buffer, self.buffered = [], 0
        self.ledger.trim()

    def finish(self) -> Iterator[Any]:
        if not self.buffered:
            return
        s = self.scoring
        out = _batch.concat(self.buffer) if s.batched else s.collate_fn(self.buffer)
        self._hand(self.buffered)
        self.buffer, self.buffered = [], 0
        yield out
