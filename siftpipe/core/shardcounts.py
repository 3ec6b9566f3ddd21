"""Shard counters: what shard readers counted (opened, skipped, retried), per process and shared
across DataLoader worker processes; the stage reads them for its audit manifests."""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ShardStats",
    "ShardWatch",
    "SharedCounters",
    "SharedShardCounts",
    "find_shard_counts",
    "hand_on",
    "merge_shard_stats",
    "reset_shard_stats",
    "shard_stats",
]


@dataclass(frozen=True)
class ShardStats:
    """Shard counters of this process (a DataLoader worker counts its own shards).

    Attributes:
        opened: Shards opened successfully.
        completed: Shards read to their end.
        skipped: Shards given up on and skipped by the handler (``warn_and_continue`` & co.).
        failed: Shards whose error was raised (``reraise_exception``).
        retries: Failed attempts that were retried (opening or reading).
        reopened: Times a stream was reopened mid-shard at its byte offset after a failed read.
        samples: Samples read from shards.
        samples_skipped: Samples skipped by the handler because a field could not be decoded or
            was missing (``WebDataset.decode()`` / ``.to_tuple()``).
        members_skipped: Tar members skipped by the handler because ``rename_files`` or
            ``select_files`` raised on their names (the sample goes on without them, or, if it
            had no other member, is not read at all).
        skipped_urls: The skipped shards, ``"<url> (<kind>)"`` (only in a pipeline's own
            ``shard_stats()``, which counts across processes; at most about 2 KiB of URLs per
            process are kept, the count ``skipped`` is always exact).
    """

    opened: int = 0
    completed: int = 0
    skipped: int = 0
    failed: int = 0
    retries: int = 0
    reopened: int = 0
    samples: int = 0
    samples_skipped: int = 0
    members_skipped: int = 0
    skipped_urls: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The counters and skipped URLs as plain JSON values."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _FIELDS}
        out["skipped_urls"] = list(self.skipped_urls)
        return out


_FIELDS: tuple[str, ...] = tuple(n for n in ShardStats.__dataclass_fields__ if n != "skipped_urls")
_INDEX: dict[str, int] = {name: i for i, name in enumerate(_FIELDS)}
_COUNTS: dict[str, int] = dict.fromkeys(_FIELDS, 0)
_COUNTS_LOCK = threading.Lock()


def count_here(name: str, n: int = 1) -> None:
    with _COUNTS_LOCK:
        _COUNTS[name] += n


def shard_stats() -> ShardStats:
    """A snapshot of this process's shard counters (see ``ShardStats``)."""
    with _COUNTS_LOCK:
        counts: dict[str, Any] = dict(_COUNTS)
    return ShardStats(**counts)


def reset_shard_stats() -> None:
    """Set this process's shard counters back to zero."""
    with _COUNTS_LOCK:
        for name in _COUNTS:
            _COUNTS[name] = 0


# counters still in this process's own memory, shared before any fork (a DataLoader's workers)
_UNSHARED: weakref.WeakSet[_SharedBuffer] = weakref.WeakSet()


def _share_before_fork() -> None:
    # a copy of the set of references, made in one C call (another thread may add to it)
    for ref in list(_UNSHARED.data):  # type: ignore[attr-defined]
        counts = ref()
        if counts is not None:
            counts.share()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_share_before_fork)


class _SharedBuffer:
    """A tensor every process running a copy of its owner writes its own row of: in the
    process's own memory until a worker process could need it (shared memory holds a file
    descriptor per buffer for as long as it lives, torch's default sharing strategy), moved to
    shared memory before a fork (``_share_before_fork``) or as it is sent to a spawned worker.
    Subclasses set ``_buffer`` and read it through ``_views`` (numpy views made where used,
    ``None`` until then); row ``_row()`` is this process's."""

    ROWS = 129  # the training process and 128 DataLoader workers

    _views: Any
    _box: list[Any]

    @property
    def _buffer(self) -> Any:
        return self._box[0]

    @_buffer.setter
    def _buffer(self, value: Any) -> None:
        # held in a one-item list that share() swaps the buffer in: a ShardWatch's finalizer
        # reads the counts of a reader gone since through it (``ShardWatch.watch``)
        box = self.__dict__.get("_box")
        if box is None:
            self.__dict__["_box"] = [value]
        else:
            box[0] = value

    def _own(self, buffer: Any) -> None:
        """Hold ``buffer`` (the process's own memory) until a worker could need it shared."""
        self._buffer = buffer
        self._views = None
        _UNSHARED.add(self)

    def share(self) -> None:
        """Move the buffer to shared memory (before a worker process forks, or as it is sent
        to a spawned one): from then on every process adds to the same one."""
        if not self._buffer.is_shared():
            # a shared copy swapped in, never the buffer moved in place: share_memory_() frees the
            # old memory under any numpy view another thread still holds (a heap corrupted).
            old = self._buffer
            start = old.clone()
            self._buffer = start.clone().share_memory_()
            self._views = None
            # what a thread counted into the old buffer while the copy was made (torchdata's
            # ParallelMapper reads its source in a thread it starts before it forks: found by
            # review, 2026-12-05, a skipped shard and 4 of 80 samples lost) is carried over
            self._carry(old.numpy(), start.numpy())
        _UNSHARED.discard(self)

    def _carry(self, old: Any, start: Any) -> None:
        """Add to the (new) buffer what was counted into ``old`` since it held ``start``."""
        raise NotImplementedError

    # the buffer travels (by handle to spawned workers); the numpy views are made where used
    def __getstate__(self) -> dict[str, Any]:
        self.share()
        return {k: v for k, v in self.__dict__.items() if k != "_views"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views = None
        if not self._buffer.is_shared():
            # a copy of its own (copy.deepcopy, pickle without torch's sharing): shared before a
            # fork too, or its forked workers would count into memory that dies with them
            _UNSHARED.add(self)

    @staticmethod
    def _row() -> int:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            return 0
        return 1 + int(info.id) % (_SharedBuffer.ROWS - 1)


class SharedShardCounts(_SharedBuffer):
    """Shard counters of one pipeline, kept in shared memory so that every process reading
    through it adds to them: the training process and its DataLoader workers alike.

    A DataLoader worker is a separate process: what it counts in its own memory (``shard_stats()``)
    never reaches the training process. These counters are a small tensor, moved to shared
    memory before a worker process is forked (a forked worker inherits it; a spawned one receives
    it by handle, as torch passes tensors) and kept in the process's own memory until then,
    one row per process (row 0: a process that is not a DataLoader worker; row ``1 + id``:
    worker ``id``), so no two processes write one cell and no lock is needed. Each row also
    keeps the URLs of the shards that process skipped, as long as they fit in ``URL_BYTES``.

    Two loaders iterating the same dataset *at the same time* share worker rows, and counts can
    then be lost; one loader (any number of workers, persistent or not) counts exactly.
    """

    URL_BYTES = 2048

    def __init__(self) -> None:
        import torch

        # one buffer (the counters, then the bytes of URLs used; then the URLs), unshared until a
        # worker could need it (a mix of hundreds of pipelines in one process ran out of file
        # descriptors when each was shared at once; webdataset's own hold none)
        self._own(torch.zeros(self._COUNTER_BYTES + self.ROWS * self.URL_BYTES, dtype=torch.uint8))

    _COUNTER_BYTES = _SharedBuffer.ROWS * (len(_FIELDS) + 1) * 8

    def _arrays(self) -> tuple[Any, Any]:
        if self._views is None:
            raw = self._buffer.numpy()
            counts = raw[: self._COUNTER_BYTES].view(np.int64).reshape(self.ROWS, len(_FIELDS) + 1)
            urls = raw[self._COUNTER_BYTES :].reshape(self.ROWS, self.URL_BYTES)
            self._views = (counts, urls)
        return self._views

    def add(self, name: str, n: int = 1) -> None:
        self._arrays()[0][self._row(), _INDEX[name]] += n

    def _carry(self, old: Any, start: Any) -> None:
        def split(raw: Any) -> tuple[Any, Any]:
            counts = raw[: self._COUNTER_BYTES].view(np.int64).reshape(self.ROWS, len(_FIELDS) + 1)
            return counts, raw[self._COUNTER_BYTES :].reshape(self.ROWS, self.URL_BYTES)

        (was, was_urls), (then, _) = split(old), split(start)
        counts, urls = self._arrays()
        counts[:, :-1] += was[:, :-1] - then[:, :-1]
        for row in map(int, np.flatnonzero(was[:, -1] > then[:, -1])):
            data = was_urls[row, int(then[row, -1]) : int(was[row, -1])]
            used = int(counts[row, -1])
            if used + data.size <= self.URL_BYTES:
                urls[row, used : used + data.size] = data
                counts[row, -1] = used + data.size

    def note_skip(self, url: str | None, kind: str | None) -> None:
        """Count a skipped shard and keep its (already redacted) URL if there is room."""
        counts, urls = self._arrays()
        row = self._row()
        counts[row, _INDEX["skipped"]] += 1
        data = f"{url} ({kind})\n".encode(errors="replace")
        used = int(counts[row, -1])
        if used + len(data) <= self.URL_BYTES:
            urls[row, used : used + len(data)] = np.frombuffer(data, np.uint8)
            counts[row, -1] = used + len(data)  # after the bytes: a reader never sees half a URL

    def totals(self) -> dict[str, int]:
        """The counters summed over every process (cheap: no URLs)."""
        counts, _ = self._arrays()
        return dict(zip(_FIELDS, map(int, counts[:, :-1].sum(0))))

    def stats(self) -> ShardStats:
        """The counters summed over every process, and the skipped URLs kept."""
        counts, urls = self._arrays()
        totals = [int(v) for v in counts[:, :-1].sum(0)]
        kept: list[str] = []
        for row in map(int, counts[:, -1].nonzero()[0]):
            text = urls[row, : int(counts[row, -1])].tobytes().decode(errors="replace")
            kept.extend(line for line in text.split("\n") if line)
        return ShardStats(**dict(zip(_FIELDS, totals)), skipped_urls=tuple(kept))

    def reset(self) -> None:
        """Zero the counters (call it while no worker is reading)."""
        self._buffer.zero_()

    def __repr__(self) -> str:
        return f"SharedShardCounts({self.stats()})"


class SharedCounters(_SharedBuffer):
    """Named counters that every process running a copy of their owner adds to: the training
    process and each of its DataLoader workers (a ``PreDecodeFilter``'s seen, dropped, kept).

    Kept as ``SharedShardCounts`` keeps its counters: one row per process (row 0: a process that
    is not a DataLoader worker; row ``1 + id``: worker ``id``), in the process's own memory until
    a worker could need them (moved to shared memory before a fork, or as they are sent to a
    spawned worker), summed when read. One loader iterating at a time counts exactly; two
    iterating copies of one owner at once share worker rows and can lose counts."""

    def __init__(self, names: Iterable[str]) -> None:
        import torch

        self.names = tuple(names)
        self._own(torch.zeros((self.ROWS, len(self.names)), dtype=torch.int64))

    def _carry(self, old: Any, start: Any) -> None:
        if self._views is None:
            self._views = self._buffer.numpy()
        self._views += old - start

    def row(self) -> Any:
        """This process's counters (a numpy view, in the order of ``names``): add to its cells."""
        if self._views is None:
            self._views = self._buffer.numpy()
        return self._views[self._row()]

    def totals(self) -> dict[str, int]:
        """Each counter summed over every process."""
        if self._views is None:
            self._views = self._buffer.numpy()
        return dict(zip(self.names, map(int, self._views.sum(0))))

    def reset(self) -> None:
        """Zero the counters (call it while no worker is running)."""
        self._buffer.zero_()

    def __repr__(self) -> str:
        return f"SharedCounters({self.totals()})"


#: The attributes a search of a source's graph follows: a DataLoader's dataset, a node's source,
#: a torchdata Loader's root, a wrapper's node, a shard reader's opener
_LINKS = ("opener", "reader", "dataset", "source", "root", "node")


def reachable(*objects: Any, prune: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """``objects`` and everything reachable from them through ``_LINKS`` and a pipeline's list
    of stages (``pipeline``), each once; ``prune(obj)`` True: do not look inside ``obj``."""
    seen: set[int] = set()
    todo = list(objects)
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen or isinstance(obj, str | bytes | int | float):
            continue
        seen.add(id(obj))
        yield obj
        if prune is not None and prune(obj):
            continue
        for attr in _LINKS:
            try:
                todo.append(getattr(obj, attr, None))
            except Exception:  # a property that cannot be read here links nowhere
                continue
        try:
            pipeline = getattr(obj, "pipeline", None)
        except Exception:
            pipeline = None
        if isinstance(pipeline, list):
            todo.extend(pipeline)


def _counts_of(obj: Any) -> SharedShardCounts | None:
    try:
        counts = getattr(obj, "counts", None)
    except Exception:  # a property that cannot be read here holds no counters
        return None
    return counts if isinstance(counts, SharedShardCounts) else None


def find_shard_counts(*objects: Any) -> list[SharedShardCounts]:
    """The shared shard counters of every shard reader in ``objects``: pipelines (``WebDataset``,
    ``WebLoader``, ``DataPipeline``), DataLoaders (their ``dataset``), ``ShardSource`` and the
    torchdata nodes above it (their ``source``, a ``Loader``'s ``root``), wrappers of a node
    (their ``node``), readers and openers."""
    found: dict[int, SharedShardCounts] = {}
    for obj in reachable(*objects, prune=lambda o: _counts_of(o) is not None):
        counts = _counts_of(obj)
        if counts is not None:  # a shard opener (or anything holding counters)
            found.setdefault(id(counts), counts)
    return list(found.values())


def follow_epoch(source: Any, epoch: int, hook: str = "follow_sifter_epoch") -> int:
    """Hand ``epoch`` to every object in ``source``'s graph (see ``reachable``) whose class
    follows the sifter's epoch (has ``follow_sifter_epoch``: ``ShardSource``, whose shard order
    is the epoch's), before a pass starts; returns how many there were.

    A ``DataLoader`` without persistent workers starts each epoch's workers from copies of the
    objects in the training process, which never read: this is how their copies learn the
    epoch. Negative epochs (which a ``ShardSource`` has no order for) are not handed on.
    ``hook``: the method to call (``follow_sifter_set_epoch``: what ``Sifter.set_epoch`` hands
    on, before a pipeline that starts its workers before the stage opens its pass)."""
    if epoch < 0:
        return 0
    return hand_on(source, hook, epoch)


def hand_on(source: Any, hook: str, value: Any) -> int:
    """Call ``hook(value)`` on every object in ``source``'s graph (see ``reachable``) whose class
    has that method; returns how many there were."""
    n = 0
    for obj in reachable(source):
        follow = getattr(type(obj), hook, None)
        if callable(follow):
            follow(obj, value)
            n += 1
    return n


def merge_shard_stats(counters: Iterable[SharedShardCounts]) -> ShardStats:
    """The stats of several shared counters, added up (URLs of skipped shards concatenated)."""
    stats = [c.stats() for c in counters]
    totals: dict[str, Any] = {name: sum(getattr(st, name) for st in stats) for name in _FIELDS}
    return ShardStats(**totals, skipped_urls=tuple(u for st in stats for u in st.skipped_urls))


class ShardWatch:
    """The shard counters a stage watches (``Sifter.watch_shards``): what the shard readers of its
    sources skipped, summed over every process that read them."""

    #: Skipped shard URLs written into each audit manifest, at most.
    REPORTED_URLS = 100

    def __init__(self) -> None:
        # weak references: a pipeline made for one pass (a loader built each epoch) is let go
        # with its shard readers, their shared memory and its threads (found by review,
        # 2026-12-06: kept for the stage's life, 9 file descriptors and a thread an epoch). What
        # a reader counted is added to ``_gone`` as it goes, so the counts stay the run's.
        self._refs: list[weakref.ref[SharedShardCounts]] = []
        self._gone: ShardStats | None = None
        # what the finalizers of readers let go found, not yet added to _gone: a deque they append
        # to without a lock (a finalizer runs wherever a garbage collection starts, inside this
        # class's own locked code too: the review of the change, a thread waiting on itself)
        self._folds: collections.deque[tuple[weakref.ref[SharedShardCounts], ShardStats]] = (
            collections.deque()
        )
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # (a pickled or copied stage: the live counters go as they are, and are watched again)
        live = self.counters  # (first: one collected after the drain would be in neither)
        self._drain()
        return {"counters": live, "gone": self._gone}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self._gone = state["gone"]
        self._add(state["counters"])

    @property
    def counters(self) -> list[SharedShardCounts]:
        """The watched shard counters still alive."""
        return [c for c in (r() for r in self._refs) if c is not None]

    def watch(self, *pipelines: Any) -> None:
        """Watch the shard readers in ``pipelines`` too (each counter once), for as long as
        something else holds them; what they counted stays counted after."""
        self._add(find_shard_counts(*pipelines))

    def _add(self, found: Iterable[SharedShardCounts]) -> None:
        live = self.counters
        self._drain()  # (the readers let go so far: their references go, in a run that never reads)
        for counts in found:
            if all(counts is not c for c in live):
                ref = weakref.ref(counts)
                with self._lock:
                    self._refs.append(ref)
                live.append(counts)
                done = weakref.finalize(counts, _fold_gone, self._folds, ref, type(counts), counts._box)
                done.atexit = False  # (at the interpreter's exit nothing reads the counts again)

    def _drain(self) -> None:
        """Add what the readers let go since counted to ``_gone``."""
        with self._lock:
            while self._folds:
                ref, stats = self._folds.popleft()
                self._refs = [r for r in self._refs if r is not ref]
                self._gone = stats if self._gone is None else _added(self._gone, stats)

    def skipped(self) -> tuple[int, int]:
        """(shards skipped, samples skipped) over the watched readers (cheap: no URLs decoded)."""
        live = self.counters  # (held while read: none of them is folded meanwhile)
        self._drain()
        gone = self._gone
        shards, samples = (0, 0) if gone is None else (gone.skipped, gone.samples_skipped)
        for counts in live:
            totals = counts.totals()
            shards += totals["skipped"]
            samples += totals["samples_skipped"]
        return shards, samples

    def stats(self) -> ShardStats | None:
        """What the watched readers counted, those let go since included (``None`` if none was
        ever watched)."""
        live = self.counters  # (held while read: none of them is folded meanwhile)
        self._drain()
        gone = self._gone
        if not live:
            return gone
        merged = merge_shard_stats(live)
        return merged if gone is None else _added(gone, merged)

    def report(self) -> dict[str, Any] | None:
        """The counters for the audit log's manifests (at most ``REPORTED_URLS`` skipped URLs)."""
        stats = self.stats()
        if stats is None:
            return None
        report = stats.as_dict()
        report["skipped_urls"] = report["skipped_urls"][: self.REPORTED_URLS]
        return report


def _fold_gone(
    folds: collections.deque[tuple[weakref.ref[SharedShardCounts], ShardStats]],
    ref: weakref.ref[SharedShardCounts],
    cls: type[SharedShardCounts],
    box: list[Any],
) -> None:
    """A watched reader's counters were let go: what they counted, for the watch's total (taken
    in by ``ShardWatch._drain``; an append, so that no lock is taken here)."""
    reader = cls.__new__(cls)  # reads the same buffer (``box``: the one share() swapped in last)
    reader.__dict__.update(_box=box, _views=None)
    folds.append((ref, reader.stats()))


def _added(a: ShardStats, b: ShardStats) -> ShardStats:
    """Two stats added up (``b``'s skipped URLs after ``a``'s)."""
    totals = {name: getattr(a, name) + getattr(b, name) for name in _FIELDS}
    return ShardStats(**totals, skipped_urls=a.skipped_urls + b.skipped_urls)
