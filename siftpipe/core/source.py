"""Reading the stage's source: one iterator per pass, iterated at the first read, with one item
of look-ahead (a checkpoint records the key of the item a resumed source must start with)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, Protocol, runtime_checkable

__all__ = ["END", "Raised", "Reader", "StatefulSource"]


@runtime_checkable
class StatefulSource(Protocol):
    """What a source implements for the stage to save its position inside the stage's own state
    (``Sifter(track_source=None)`` tracks any source that has both methods).

    It is iterable (each ``iter()`` is a pass); ``state_dict()`` says where the next item comes
    from, and after ``load_state_dict(state)`` the next iteration continues from there. The stage
    takes the state at group boundaries, after the pass has iterated the source.
    ``torchdata.stateful_dataloader.StatefulDataLoader`` is one; an adapter wraps whatever it
    reads from in one (``siftpipe.adapters.nodes`` wraps a ``BaseNode``). docs/design.md says
    what else an adapter does."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


#: What ``Reader.next`` and ``look_ahead`` return at the source's end.
END = object()
_NOTHING = object()


class Reader:
    """The source iterator of a running pass. ``state_dict()`` may read one item ahead, to record
    the key of the item the resumed source must start with; the pass then takes that item first.
    """

    __slots__ = (
        "__weakref__", "ahead", "ahead_snapshot", "began", "failed", "it", "pulled", "skipped", "skips",
        "source",
    )  # fmt: skip

    def __init__(self, source: Iterable[Any], began: Callable[[], None]) -> None:
        self.source = source
        self.began = began  # called once, when the source is first iterated
        # iterated at the first read, not when the pass is opened: a pass opened and dropped
        # unread leaves a DataLoader where it was (iterating it starts an epoch)
        self.it: Iterator[Any] | None = None
        self.ahead: Any = _NOTHING  # an item, END, or the exception reading it raised
        self.ahead_snapshot: Any = None  # the tracked source's state before that item
        #: items the source gave this pass (a resumed pass's count starts at the checkpoint's
        #: ``consumed``): where an error it raises stands
        self.pulled = 0
        #: where errors the checkpoint's pass already raised to its caller stand (ascending): a
        #: resumed pass re-reading from an earlier item meets them again and passes over them
        self.skips: list[int] = []
        #: where the errors it passed over since the last snapshot (``snapshot_taken``) stood
        self.skipped: list[int] = []
        #: the error the source's last read raised, if nothing was read since: a generator that
        #: raised then ends, and that end is the error's, not the source's
        self.failed: Exception | None = None

    @property
    def has_ahead(self) -> bool:
        """Whether an item (or the end, or an error) was read ahead and not yet taken."""
        return self.ahead is not _NOTHING

    def iterate(self) -> Iterator[Any]:
        """The source's iterator (``iter(source)`` at the first call)."""
        it = self.it
        if it is None:  # (never `self.it or ...`: a DataLoader iterator's truth is its __len__)
            it = self.it = iter(self.source)
            self.began()
        return it

    def release(self) -> None:
        """Let go of the source's iterator (a generator is closed, a DataLoader's workers stop,
        once nothing else holds it): the pass was closed, and its iterator outlives it."""
        self.it = None
        self.ahead = self.ahead_snapshot = None

    def look_ahead(self, snapshot: Any) -> Any:
        """The next item (read now, or earlier), ``END``, or the exception reading it raised."""
        if self.ahead is _NOTHING:
            self.ahead_snapshot = snapshot
            self.snapshot_taken()
            try:
                self.ahead = self._pull()
            except StopIteration:
                # after an error, a generator's end (found by review, 2026-12-05: a checkpoint
                # taken as the pass handed on its last rows before raising recorded that the
                # source had ended, and refused the resume fed from the failed item)
                self.ahead = END if self.failed is None else Raised(self.failed)
            except Exception as exc:  # raised again where the pass reads it
                self.ahead = Raised(exc)
        return self.ahead

    def _pull(self) -> Any:
        """The source's next item (``StopIteration`` at its end), past errors already raised."""
        it = self.iterate()
        while True:
            try:
                item = next(it)
            except StopIteration:
                raise
            except Exception as exc:
                if self.skips and self._raised_before():
                    continue
                self.failed = exc
                raise
            self.pulled += 1
            self.failed = None
            return item

    def snapshot_taken(self) -> None:
        """The source's state was just taken (the next group's): errors passed over from here on
        stand after it."""
        if self.skipped:
            self.skipped = []

    def _raised_before(self) -> bool:
        """Whether the error the source raised at ``pulled`` is one the checkpoint's pass raised
        to its caller already (it is then passed over: said once is enough)."""
        skips = self.skips
        while skips and skips[0] < self.pulled:
            del skips[0]  # an error that did not come again (a transient one)
        if skips and skips[0] == self.pulled:
            del skips[0]
            self.skipped.append(self.pulled)
            return True
        return False

    def _take_ahead(self) -> Any:
        item = self.ahead
        if isinstance(item, Raised):
            self.ahead = _NOTHING
            raise item.exc
        if item is not END:  # the end stays: the iterator is not asked again
            self.ahead = _NOTHING
        return item

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` items (fewer at the end; the end is remembered, the source not asked again).

        When the source raises after some items were read, those are returned and the error is
        held (``ahead``): the next read raises it, after the items read before it are decided."""
        if self.ahead is _NOTHING:
            items: list[Any] = []
        else:
            first = self._take_ahead()
            if first is END:
                return []
            items = [first]
        while True:
            had = len(items)
            try:
                items.extend(islice(self.iterate(), n - had))  # keeps what came before an error
            except Exception as exc:
                self.pulled += len(items) - had
                if self.skips and self._raised_before():
                    continue
                self.failed = exc
                if not items:
                    raise
                self.ahead = Raised(exc)
                return items
            self.pulled += len(items) - had
            if len(items) > had:
                self.failed = None
            break
        if len(items) < n:
            self.ahead = END
        return items

    def raise_held(self) -> None:
        """Raise the error a short ``take`` held back (the source failed after the items it
        returned), if there is one."""
        held = self.ahead
        if isinstance(held, Raised):
            self.ahead = _NOTHING
            raise held.exc

    def next(self) -> Any:
        """The next item, or ``END`` (remembered)."""
        if self.ahead is not _NOTHING:
            return self._take_ahead()
        try:
            return self._pull()
        except StopIteration:
            self.ahead = END
            return END


class Raised:
    """What ``look_ahead`` returns when reading the item raised: the pass raises it when it reads."""

    __slots__ = ("exc",)

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
