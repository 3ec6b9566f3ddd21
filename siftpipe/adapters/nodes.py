"""torchdata.nodes integration: a sift node and a stateful shard source.

A pipeline that decodes in worker processes, sifts with the live model in the training process
and resumes exactly from ``loader.state_dict()``::

    from torchdata.nodes import Batcher, Mapper, ParallelMapper
    from siftpipe.nodes import Loader, ShardSource, SiftNode  # torchdata's Loader, mended
    from siftpipe.shards import decode_sample

    source = ShardSource("s3://bucket/train-{000000..000099}.tar", storage_options={...})
    decoded = ParallelMapper(source, decode_sample, num_workers=4, method="process")
    batches = Mapper(Batcher(decoded, batch_size=256), default_collate)
    loader = Loader(SiftNode(batches, sp.Sifter(model, "cross_entropy", batched=True)))

    for batch in loader: ...
    torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, path)
    ...
    loader.load_state_dict(torch.load(path, weights_only=True)["loader"])  # continues exactly
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from torchdata.nodes import BaseNode
from torchdata.nodes import Loader as _TorchdataLoader
from torchdata.nodes.loader import LoaderIterator as _TorchdataLoaderIterator

from ..core.resume import shard_name
from ..core.source import Raised
from ..core.stage import Sifter
from ..errors import ConfigError, ResumeError, ShardError, ShardWarning
from ..streaming import handlers
from ..streaming.handlers import *  # noqa: F403  (the handler names, listed once in siftpipe.handlers)
from ..streaming.handlers import reraise_exception
from ..streaming.opener import (
    MAX_MEMBER_BYTES,
    MAX_SAMPLE_BYTES,
    OpenerOptions,
    ShardReader,
    ShardStats,
    redact_options,
    redact_url,
    shard_opener,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Loader",
    "ShardSource",
    "ShardStats",
    "SiftNode",
]
__all__ += handlers.__all__


class _NodeSource:
    """A BaseNode seen as the stateful iterable the Sifter tracks (``state_dict`` /
    ``load_state_dict``): its state is snapshotted at micro-batch boundaries and restored with
    ``reset(state)``."""

    __slots__ = ("node",)

    def __init__(self, node: BaseNode[Any]) -> None:
        self.node = node

    def __iter__(self) -> Iterator[Any]:
        return self.node

    def state_dict(self) -> dict[str, Any]:
        # a copy: the sifter keeps this snapshot while the node moves on, and a node may hand
        # out (and later change) its own internal dicts
        return copy.deepcopy(self.node.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.node.reset(state)

    def ask_at_end(self) -> None:
        """The node was restored at its end: ask it once more (its ``StopIteration``), as
        torchdata's ``Loader`` asked the uninterrupted pipeline. A ``SamplerWrapper`` or a
        ``MultiNodeWeightedSampler`` moves on to its next epoch at ``reset(None)`` only if
        ``next()`` came after ``reset(state)``: without it, a resumed run's epochs went in the
        checkpoint epoch's order (found by review, 2026-12-05)."""
        with contextlib.suppress(StopIteration):
            next(self.node)


class SiftNode(BaseNode[Any]):
    """A ``torchdata.nodes`` node that sifts its source's items with a ``Sifter``.

    Put it after the nodes that decode and batch (``ParallelMapper`` with
    ``method="process"``, ``Batcher``): it runs where it is iterated, in the training process,
    scoring with the live model. Its state is the sifter's state, which holds the source node's
    state snapshotted at the sifter's ``consumed`` boundary: ``reset(state)`` (and a ``Loader``'s
    ``load_state_dict``) repositions the source there, replays the decisions made but not yet
    handed on, and continues exactly as the uninterrupted run.

    Args:
        source: The node whose items (samples, or collated batches with ``batched=True``) are
            sifted.
        sifter: The stage. It tracks the source itself (``track_source`` must not be False).

    Each ``reset(None)`` starts a new pass (the sifter's ``epoch`` + 1 after the first) and
    resets the source; the sifter's loss history and counters carry over between passes.

    A row counts as handed on when this node's ``next()`` returns it: batch kept rows with the
    sifter's ``output_batch``/``drop_last``, not with a ``Batcher(drop_last=True)`` or an
    ``Unbatcher`` above this node, whose discarded rows would read as kept in the audit log. One
    ``Sifter`` per ``SiftNode`` (the same model may serve several).
    """

    STATE_VERSION = 1

    def __init__(self, source: BaseNode[Any], sifter: Sifter) -> None:
        super().__init__()
        if not isinstance(source, BaseNode):
            raise ConfigError(
                f"SiftNode's source must be a torchdata.nodes.BaseNode, got {type(source).__name__}; "
                "wrap an iterable with torchdata.nodes.IterableWrapper"
            )
        if not isinstance(sifter, Sifter):
            raise ConfigError(f"SiftNode needs a siftpipe.Sifter, got {type(sifter).__name__}")
        if sifter.track_source is False:
            raise ConfigError(
                "SiftNode keeps the source node's position inside the sifter's state, so the sifter "
                "must track its source: construct it with track_source=None (the default) or True"
            )
        self.source = source
        self.sifter = sifter
        sifter.watch_shards(source)  # shards a ShardSource below skips count in sifter.stats
        self._wrapped = _NodeSource(source)
        self._it: Iterator[Any] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        # Resetting the source may fork worker processes (ParallelMapper, method="process").
        # Collect the previous pass's mapper iterators first: left as cyclic garbage they are
        # copied into the new workers, whose garbage collector then runs their __del__ there
        # (AssertionError "can only test a child process", and on CPython 3.11.7 an occasional
        # "SystemError: AST constructor recursion depth mismatch" inside np.load).
        gc.collect()
        if initial_state is None:
            # from the beginning (torchdata's reset(None)), also right after a reset(state) of a
            # pass still open, nothing read since (MultiNodeWeightedSampler does that): that pass
            # is given up, as one left early is, and the next begins. Before 2026-12-05 it was
            # resumed against the source reset here: a ResumeError, or an empty epoch
            self.sifter._give_up_loaded_pass()
            # the call first hands the source a between-passes checkpoint's state (if one was
            # loaded); resetting it then starts the epoch after that one
            self._it = self.sifter._surviving(self._wrapped)
            if self.sifter._passes.source_restored:
                self._wrapped.ask_at_end()  # restored where the checkpoint's pass ended
            self.source.reset(None)
            return
        if not isinstance(initial_state, Mapping) or initial_state.get("version") != self.STATE_VERSION:
            raise ResumeError(
                "not a SiftNode state (no matching 'version'); pass the state that this node's "
                "state_dict() (or the Loader's) returned"
            )
        state = initial_state["sifter"]
        self.sifter.load_state_dict(state)
        if state["pass_open"]:
            # repositions the source, replays pending groups
            self._it = self.sifter._surviving(self._wrapped)
        else:  # the checkpoint fell at the end of a pass: nothing left until the next reset(None)
            self._it = None

    def next(self) -> Any:
        if self._it is None:
            raise StopIteration
        item = next(self._it)
        if type(item) is Raised:
            # the source raised: its error goes to the caller, and the pass goes on from the next
            # read, as the node's own next() would (a transient error does not end the epoch)
            raise item.exc
        return item

    def get_state(self) -> dict[str, Any]:
        return {"version": self.STATE_VERSION, "sifter": self.sifter.state_dict()}

    def __repr__(self) -> str:
        return f"SiftNode({type(self.source).__name__}, {self.sifter!r})"


def _rank_known() -> bool:
    """Whether ``_rank_and_world`` reads a rank that will not change: a process group, or both
    ``RANK`` and ``WORLD_SIZE`` in the environment (webdataset reads neither alone)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        from webdataset.utils import pytorch_worker_info

        env_rank, env_world, _, _ = pytorch_worker_info()
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    return rank, world_size


def _worker() -> tuple[int, int]:
    """``(worker id, number of workers)`` of this process's DataLoader worker, ``(0, 1)`` outside
    one: webdataset's ``pytorch_worker_info`` (torch's ``get_worker_info``, or the ``WORKER`` and
    ``NUM_WORKERS`` environment variables)."""
    from webdataset.utils import pytorch_worker_info

    _, _, worker, num_workers = pytorch_worker_info()
    return int(worker), int(num_workers)


class ShardSource(BaseNode[dict[str, Any]]):
    """A stateful ``torchdata.nodes`` source of WebDataset samples from tar shards at any fsspec
    URL, read through the same opener as ``siftpipe.webdataset.WebDataset`` (storage options,
    retries with backoff, mid-stream reconnects, handlers, ``shard_stats()``).

    Yields raw samples: dicts with ``__key__``, ``__url__`` (``__local_path__`` too for a local
    shard, as in webdataset) and one ``bytes`` value per field
    (decode them with ``siftpipe.shards.decode_sample``, e.g. in a ``ParallelMapper``).

    Its state is ``(epoch, shard index, samples read from that shard, byte offset of the next
    sample, its key, DataLoader worker and number of workers)``: resuming seeks straight to the
    next sample of an uncompressed shard (a compressed one is re-read from its start and the
    samples before skipped), never re-reading the epoch from its beginning. The shard URL, the
    next sample's key and the worker are checked on resume
    (``ResumeError`` if the shards changed since the checkpoint, or the shard holds no tar
    member at the saved offset any more).

    Args:
        urls: A brace pattern (``s3://bucket/train-{000000..000099}.tar``) or a list of URLs
            (any fsspec URL, a local path, or webdataset's ``pipe:COMMAND``).
        storage_options: fsspec options (see ``ShardOpener``); ``None``: the environment.
        handler: ``reraise_exception`` (default), ``warn_and_continue`` (skip a shard that cannot
            be read, counted in ``shard_stats().skipped``), or any webdataset handler.
        shuffle: Shuffle the shard order each epoch (from ``seed`` and the epoch number, so
            every rank agrees and a resumed run sees the same order).
        seed: Seed of the shard shuffle.
        rank, world_size: This process's share: shards ``rank::world_size`` of each epoch's
            order. Default: from ``torch.distributed`` or the ``RANK``/``WORLD_SIZE`` environment,
            read when first needed once either says it (a source made before
            ``init_process_group`` reads its own share). Inside a DataLoader worker (a source
            wrapped in an ``IterableDataset``, which every worker iterates), the worker then takes
            every ``num_workers``-th of those, from its id on: webdataset's ``split_by_node``
            then ``split_by_worker``, so that no sample is read twice. A rank or a worker left
            without shards is a ``ConfigError``.
        retries, backoff, max_backoff, timeout, block_size: see ``ShardOpener``.
        select_files, rename_files: as in webdataset: filter and rename tar members.
        max_member_bytes: The largest tar member read, in bytes (default 256 MiB; ``None``: no
            limit); a larger one fails its shard (``ShardError``, kind ``too_large``, naming the
            shard and the member, handled by ``handler``) before any of it is read.
        max_sample_bytes: The most one sample's members may hold together, in bytes, each counted
            with its 512-byte header (default 1 GiB; ``None``: no limit).
    """

    STATE_VERSION = 1

    def __init__(
        self,
        urls: str | list[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        handler: Callable[[BaseException], bool] = reraise_exception,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        max_member_bytes: int | None = MAX_MEMBER_BYTES,
        max_sample_bytes: int | None = MAX_SAMPLE_BYTES,
        **opener: Unpack[OpenerOptions],
    ) -> None:
        super().__init__()
        from .webdataset import expand_urls

        self.urls = expand_urls(urls)
        self.opener = shard_opener(storage_options, opener, "ShardSource")
        self.reader = ShardReader(
            self.opener,
            handler,
            select_files=select_files,
            rename_files=rename_files,
            max_member_bytes=max_member_bytes,
            max_sample_bytes=max_sample_bytes,
        )
        self.shuffle = shuffle
        self.seed = seed
        _rank_and_world(rank, world_size)  # (checked now, a bad value said at once)
        self._rank_given, self._world_given = rank, world_size
        self._ranks: tuple[int, int] | None = None  # fixed once the rank is known
        self._read_as: tuple[int, int] | None = None  # the share a pass read before that
        if (rank is not None and world_size is not None) or _rank_known():
            self._check_share()
        self.epoch = 0
        self._next_epoch: int | None = None  # the next pass's epoch, when set (set_epoch)
        self._next_by_user = False  # ... by set_epoch, not by a sifter (follow_sifter_epoch)
        self._fresh = False  # reset(None) started a pass that has read nothing yet
        self._fresh_by_user = False  # ... at an epoch set_epoch gave
        self._started = False
        self._order: list[str] = []
        self._shard = 0
        self._sample = 0
        self._offset: int | None = 0
        self._next_key: str | None = None
        #: the current shard's version as opened (size, and ETag, generation or version id, or a
        #: local file's modification time: ``_version_of``), as pairs; ``None`` before it opens
        self._shard_version: list[list[Any]] | None = None
        self._worker = (0, 1)  # (DataLoader worker, workers) the current order was made for
        self._gen: Generator[dict[str, Any], None, None] | None = None

    def _shown(self, url: str) -> str:
        """``url`` as the source shows it (state, errors, repr): no credentials, no secret values
        from the environment or the storage options."""
        return self.opener.redact(redact_url(url))

    def __repr__(self) -> str:
        first = self._shown(self.urls[0])
        return (
            f"ShardSource({len(self.urls)} shard(s): {first}{', ...' if len(self.urls) > 1 else ''}; "
            f"storage_options={redact_options(self.opener.storage_options)}, rank {self.rank} of "
            f"{self.world_size}, shuffle={self.shuffle})"
        )

    def shard_stats(self) -> ShardStats:
        """This source's shard counters (opened, skipped, retries, ...), in every process."""
        return self.opener.stats()

    @property
    def rank(self) -> int:
        """This process's rank: as given, else torch.distributed's (or ``$RANK``), read when first
        needed once known, so a source made before ``init_process_group`` reads its own share
        (found by review, 2026-12-05: fixed as 0 of 1 when made, every rank read every shard)."""
        return self._rank_world()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks the shards are split over (see ``rank``)."""
        return self._rank_world()[1]

    def _rank_world(self) -> tuple[int, int]:
        if self._ranks is not None:
            return self._ranks
        found = _rank_and_world(self._rank_given, self._world_given)
        given = self._rank_given is not None and self._world_given is not None
        # settled once what it is read from says it: a process group, or both variables (RANK
        # alone reads as 0 of 1: found by the review of the fix, every rank then read everything)
        if given or _rank_known():
            self._ranks = found
            if self._read_as is not None and self._read_as != found:
                warnings.warn(
                    f"siftpipe: ShardSource read a pass as rank {self._read_as[0]} of "
                    f"{self._read_as[1]} before the process group said its rank (it was made and "
                    f"read before init_process_group): that pass read another share than this "
                    f"rank's ({found[0]} of {found[1]}), which it reads from now on. Start the "
                    "process group before reading the data",
                    ShardWarning,
                    stacklevel=3,
                )
        return found

    def _check_share(self) -> None:
        if not self.urls[self.rank :: self.world_size]:
            raise ConfigError(
                f"rank {self.rank} of {self.world_size} gets none of the {len(self.urls)} shard(s): "
                "write at least as many shards as ranks"
            )

    def order(self, epoch: int) -> list[str]:
        """This rank's (and, in a DataLoader worker, this worker's) shard URLs for ``epoch``, in
        reading order. Raises ``ConfigError`` if a worker gets none."""
        # split by rank first, then shuffle the rank's own shards (webdataset's order too): a rank
        # reads the same samples every epoch, which its score memory learned (permuted across
        # ranks, they moved to other ranks each epoch, and a per-rank memory knew ever fewer)
        self._check_share()
        if self._ranks is None:
            self._read_as = self._rank_world()  # (not settled yet: said if it changes)
        ranks = list(self.urls)[self.rank :: self.world_size]
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(ranks))
            ranks = [ranks[i] for i in perm]
        worker, workers = _worker()
        mine = ranks[worker::workers]
        if not mine:
            raise ConfigError(
                f"DataLoader worker {worker} of {workers} (rank {self.rank} of {self.world_size}) gets "
                f"none of this rank's {len(ranks)} shard(s): use at most {len(ranks)} worker(s), or write "
                f"at least ranks x workers = {self.world_size * workers} shards"
            )
        return mine

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s shard order in the pass that has been reset and has read nothing
        yet, or else in the next one (the next ``reset(None)``), as
        ``DistributedSampler.set_epoch`` does; passes after it count on from there.

        Without it each new pass is the epoch after the last one this object read, which in a
        ``DataLoader`` whose workers are not persistent is always epoch 0 (each epoch's workers
        start from a copy of the object in the training process, which reads nothing), so
        ``shuffle=True`` would repeat one order. A ``Sifter`` hands this node its own epoch before
        each pass (``follow_sifter_epoch``) when the source it is given holds it (through
        ``dataset``, ``source``, ``root``, ``node`` attributes); an epoch given here wins over the
        sifter's for that pass, and a restored state (``reset(state)``) over both. Persistent
        workers keep their own copies: they take the epoch of their first pass and count on."""
        if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer) or epoch < 0:
            raise ConfigError(f"set_epoch takes the epoch number, an int >= 0, got {epoch!r}")
        self._set_epoch(int(epoch), by_user=True)

    def follow_sifter_epoch(self, epoch: int) -> None:
        """A ``Sifter``'s ``set_epoch`` for the pass it starts: ignored when ``set_epoch`` gave
        that pass an epoch (siftpipe.core.shardcounts.follow_epoch calls it)."""
        if (self._fresh and self._fresh_by_user) or (self._next_epoch is not None and self._next_by_user):
            return
        self._set_epoch(int(epoch), by_user=False)

    def _set_epoch(self, epoch: int, by_user: bool) -> None:
        if self._fresh:
            # reset and not read yet (a node reset by hand before the sifter is called): this pass
            self._start_pass(epoch)
            self._fresh_by_user = by_user
            self._next_epoch, self._next_by_user = None, False
        else:
            self._next_epoch, self._next_by_user = epoch, by_user

    def _start_pass(self, epoch: int) -> None:
        if self._gen is not None:
            self._gen.close()
        self.epoch = epoch
        self._started = False
        self._order = self.order(epoch)
        self._worker = _worker()
        self._shard, self._sample, self._offset, self._next_key = 0, 0, 0, None
        self._shard_version = None
        self._gen = self._samples()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        next_epoch, by_user = self._next_epoch, self._next_by_user
        self._next_epoch, self._next_by_user = None, False
        if initial_state is None:
            if next_epoch is None:
                next_epoch = self.epoch + 1 if self._started else self.epoch
            self._start_pass(next_epoch)
            self._fresh, self._fresh_by_user = True, by_user
        else:
            self._fresh = self._fresh_by_user = False
            self._restore(initial_state)
            self._gen = self._samples()

    # a running pass (a generator) stays in its process: a copy pickled into a DataLoader worker
    # starts a pass there with that worker's share (the position travels in get_state(), checked)
    def __getstate__(self) -> dict[str, Any]:
        # the rank settled here, in the training process, once it is known: a spawned worker has
        # no process group to read it from (as PreDecodeFilter's)
        self._rank_world()
        state = self.__dict__.copy()
        state["_gen"] = None
        return state

    def _restore(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != self.STATE_VERSION:
            raise ResumeError(
                "not a ShardSource state (no matching 'version'); pass what state_dict() returned"
            )
        worker, workers = _worker()
        saved = (int(state.get("worker", 0)), int(state.get("num_workers", 1)))
        if saved != (worker, workers):
            raise ResumeError(
                f"the checkpoint was taken in DataLoader worker {saved[0]} of {saved[1]}, this source "
                f"runs in worker {worker} of {workers}: each worker reads its own shards, so resume "
                "with the same number of workers (a StatefulDataLoader restores each worker's state "
                "in that worker)"
            )
        order = self.order(int(state["epoch"]))
        if len(order) != state["num_shards"]:
            raise ResumeError(
                f"the checkpoint's epoch had {state['num_shards']} shard(s) for this rank, this source has "
                f"{len(order)}: resume with the same shard list, seed, rank and world_size"
            )
        shard = int(state["shard"])
        expected = state.get("url")
        # (states written before secret values were redacted here too hold redact_url's form)
        here = order[shard] if shard < len(order) else None
        if (
            here is not None
            and expected is not None
            and expected not in (self._shown(here), redact_url(here))
        ):
            # another URL: the same shard at another mount point, or a presigned URL signed again,
            # has the same file name, as the order's digest goes by (found by review, 2026-12-05);
            # so has another dataset's shard named alike, which nothing tells apart at a shard's
            # start: said, so that a wrong one does not pass unnoticed
            name = shard_name(str(expected))
            if name is None or name != shard_name(here):
                raise ResumeError(
                    f"the checkpoint was reading shard {self.opener.redact(str(expected))} at position "
                    f"{shard}, this source has {self._shown(here)} there: resume with the same shard "
                    "list, seed, rank and world_size"
                )
            warnings.warn(
                f"resuming shard {shard} of the checkpoint's epoch from {self._shown(here)}, where the "
                f"checkpoint read {self.opener.redact(str(expected))}: taken as the same shard (same "
                "file name) moved or signed again. If these are other shards, stop: the resumed "
                "epoch would mix two datasets",
                ShardWarning,
                stacklevel=3,
            )
        # by the shards' paths below the epoch's common folder (states before 2026-12-05, eighth
        # session, hold only the digest by file names: "order"; before that, none)
        names, paths = self._order_digests(order)
        # both, where the state has both: the paths' leaves out an http URL's query, which may
        # be all that tells its shards apart (https://host/get?file=shard-000003.tar; found by
        # review, 2026-12-05), and the names' the folders
        differ = (state.get("order") not in (None, names)) or (state.get("order_paths") not in (None, paths))
        if differ:
            raise ResumeError(
                f"the checkpoint's epoch read its {len(order)} shard(s) in another order than this "
                "source gives for it (a reordered shard list, another seed): resumed, it would read "
                "some shards twice and others never. Resume with the same shard list, seed, rank "
                "and world_size"
            )
        self.epoch = int(state["epoch"])
        self._order = order
        self._worker = (worker, workers)
        self._shard = shard
        self._sample = int(state["sample"])
        self._offset = None if state["offset"] is None else int(state["offset"])
        self._next_key = state["next_key"]
        version = state.get("shard_version")  # (states before 2026-12-05 have none)
        self._shard_version = [list(pair) for pair in version] if version else None
        self._started = bool(state["started"])

    def next(self) -> dict[str, Any]:
        if self._gen is None:  # a copy pickled into this process
            self.reset(None)
        assert self._gen is not None
        self._started = True
        self._fresh = False
        try:
            return next(self._gen)
        except StopIteration:
            raise
        except BaseException:
            # a generator that raised is over: the next call reads on from the position (past
            # a shard that failed), where it ended the epoch quietly, the rest of it unread
            self._gen = self._samples()
            raise

    def get_state(self) -> dict[str, Any]:
        shard = self._shard
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "num_shards": len(self._order),
            "shard": shard,
            "url": self._shown(self._order[shard]) if shard < len(self._order) else None,
            "sample": self._sample,
            "offset": self._offset,
            "next_key": self._next_key,
            "shard_version": self._shard_version,
            # the epoch's whole shard order (found by review, 2026-12-05: a list reordered around
            # the current shard resumed, reading some shards twice and others never)
            "order": self._order_digests(self._order)[0],
            # the same by the shards' paths below their common folder (found by review,
            # 2026-12-05: shards of three datasets all named train-000000.tar resumed under
            # another seed, one dataset read twice and one never, nothing said)
            "order_paths": self._order_digests(self._order)[1],
            "started": self._started,
            "worker": self._worker[0],
            "num_workers": self._worker[1],
        }

    def _order_digests(self, order: list[str]) -> tuple[str, str]:
        """Digests of an epoch's shard order: by the shards' file names, and by their paths below
        the folder common to the epoch's shards (``laion/train-000000.tar``, told apart from
        ``coyo/train-000000.tar``). Both stay the same where a mount point or a presigned URL's
        signature changes across a restart; a URL without a tar file name goes by its shown
        form (no credentials). Kept for the order last asked about (get_state runs after every
        item under a prefetcher)."""
        cached = getattr(self, "_digested", None)
        if cached is not None and cached[0] is order:
            return cached[1]  # type: ignore[no-any-return]
        import hashlib

        shown = [self._shown(url) for url in order]
        # an http(s) URL's query and fragment (a presigned URL's date and signature) are not its path
        bare = [
            u.split("#", 1)[0].split("?", 1)[0] if u.startswith(("http://", "https://")) else u for u in shown
        ]
        # by characters, up to the last "/" they share: URLs are not OS paths (commonpath would
        # fold s3:// into s3:/)
        cut = os.path.commonprefix(bare).rfind("/") + 1  # noqa: RUF071
        by_name, by_path = hashlib.blake2b(digest_size=12), hashlib.blake2b(digest_size=12)
        for url, shown_url, path in zip(order, shown, bare):
            by_name.update((shard_name(url) or shown_url).encode(errors="surrogateescape") + b"\0")
            by_path.update(path[cut:].encode(errors="surrogateescape") + b"\0")
        digests = (by_name.hexdigest(), by_path.hexdigest())
        self._digested = (order, digests)
        return digests

    # ------------------------------------------------------------------ reading

    def _advance(self) -> None:
        self._shard += 1
        self._sample, self._offset, self._next_key = 0, 0, None
        self._shard_version = None

    def _samples(self) -> Generator[dict[str, Any], None, None]:
        while self._shard < len(self._order):
            index = self._shard
            url = self._order[index]
            err: ShardError | None = None
            key: str | None = None
            try:
                for sample in self._shard_samples(url):
                    key = sample["__key__"]
                    yield sample
            except (ResumeError, ConfigError):
                raise
            except Exception as exc:  # handed to the handler below
                if getattr(exc, "_handler_raised", False):
                    # the handler raised it for one of the shard's members: asked once, as is
                    self.opener.count("failed")
                    if self._shard == index:
                        self._advance()
                    raise
                err = self.opener.error(exc, url, key)
                del exc
            if err is None:
                self.opener.count("completed")
            else:
                state: dict[str, Any] = {}
                if self._shard == index:
                    # past the failed shard first: a consumer that goes on after the error (a
                    # SiftNode's does) reads the next shard, and a checkpoint says so
                    self._advance()
                self.reader.handle(err, state)  # raises with reraise_exception
                if state.get("stop"):
                    self._shard = len(self._order)
                    self._sample, self._offset, self._next_key = 0, 0, None
                    self._shard_version = None
                    return
            if self._shard == index:  # an empty or failed shard: move on
                self._advance()

    def _resumed_at(self, samples: Iterator[Any], url: str, offset: int) -> Iterator[Any]:
        """``samples``; when resuming inside a shard (at the checkpoint's byte ``offset``), a tar
        that cannot be read there before its first sample is a ``ResumeError``: the checkpoint's
        offset began a sample, so the shard changed since (rewritten, shorter) or was damaged
        there. Not a corrupt shard for the handler to skip: the rest of it would be lost."""
        if not offset or self._next_key is None:
            yield from samples
            return
        try:
            first = next(iter(samples), None)
        except (ResumeError, ConfigError):
            raise
        except Exception as exc:
            err = self.opener.error(exc, url, None)
            if err.kind != "corrupt" or self._sample_begins_at(url, offset):
                # the checkpoint's sample begins where it said: the damage lies further on, and
                # is the handler's, as in the uninterrupted pass (found by review, 2026-12-05:
                # a corrupt header before the next sample's end was taken for a changed shard)
                raise
            raise ResumeError(
                f"shard {self._shown(url)} holds no tar member at the checkpoint's position (byte "
                f"{offset}, the sample {self._next_key!r} after {self._sample} sample(s); "
                f"{type(exc).__name__} there): it changed since the checkpoint (rewritten, or "
                "shorter), or was damaged there; resume with the shards the checkpoint was made with"
            ) from None
        if first is not None:
            yield first
            yield from samples

    def _sample_begins_at(self, url: str, offset: int) -> bool:
        """Whether the tar header at byte ``offset`` of ``url`` is whole and names a member of the
        sample the checkpoint expected next (``_next_key``); False when it cannot be read."""
        import tarfile

        try:
            stream = self.opener.open(url, offset, count=False)  # a peek, not a read of the shard
            try:
                # the member's header with the extended ones before it: a name that is long or not
                # ASCII comes in a PAX or GNU long-name header first (found by review, 2026-12-05:
                # read as the member's own, the damage was taken for a changed shard)
                with tarfile.open(fileobj=stream, mode="r|", errors="surrogateescape") as tar:
                    info = tar.next()
            finally:
                stream.close()
        except Exception:  # unreadable there: not where the checkpoint said
            return False
        return info is not None and bool(self._next_key) and info.name.startswith(f"{self._next_key}.")

    def _check_version(self, stream: Any, url: str) -> None:
        """Note the opened shard's version; resuming inside it, it must be the checkpoint's."""
        opened = [[str(k), str(v)] for k, v in stream.version] if stream.version else None
        saved = self._shard_version if self._sample > 0 else None
        if saved and opened and saved != opened:
            was: dict[str, str] = {str(k): str(v) for k, v in saved}
            now: dict[str, str] = {k: v for k, v in opened}
            changed = ", ".join(
                f"{k} {was.get(k)} -> {now.get(k)}" for k in {**was, **now} if was.get(k) != now.get(k)
            )
            raise ResumeError(
                f"shard {self._shown(url)} changed since the checkpoint ({changed}): the checkpoint, "
                f"taken after {self._sample} of its samples, expected {self._next_key!r} next, and "
                "what it holds from there now is not the rest of what was read then. Resume with "
                "the shards the checkpoint was made with; "
                "a local shard copied again over itself counts as changed (its modification time), "
                "so write new shards under new names, or start the pass again (reset(None))"
            )
        self._shard_version = opened

    def _shard_samples(self, url: str) -> Iterator[dict[str, Any]]:
        """The rest of one shard from the current position; advances the position as it yields."""
        skip = 0
        offset = 0
        if self._sample > 0:
            if self._offset is not None:
                offset = self._offset
            else:  # compressed: no seekable offsets, re-read and skip
                skip = self._sample
        expected = self._next_key
        read = 0  # samples read from the stream so far; the first `skip` were handed on before
        stream = self.opener.open(url, offset)
        try:
            self._check_version(stream, url)
            tar = self.reader.tar_samples(stream, url, start=offset, judged=lambda: read < skip)
            samples = self._resumed_at(tar, url, offset)
            for n, (sample, next_offset, next_key) in enumerate(samples):
                read = n + 1
                if n < skip:
                    continue
                if expected is not None:
                    if sample["__key__"] != expected:
                        raise ResumeError(
                            f"shard {self._shown(url)} changed since the checkpoint: the sample after "
                            f"{self._sample} sample(s) is {sample['__key__']!r}, the checkpoint expected "
                            f"{expected!r}; resume with the shards the checkpoint was made with"
                        )
                    expected = None
                self.opener.count("samples")
                if next_key is None:  # the shard's last sample: the position moves to the next shard
                    self._advance()
                else:
                    self._sample += 1
                    self._offset = next_offset
                    self._next_key = next_key or None  # "": not known yet (re-read, skip by count)
                yield sample
            if expected is not None:
                raise ResumeError(
                    f"shard {self._shown(url)} ends before the sample {expected!r} the checkpoint "
                    f"expected after {self._sample} sample(s); resume with the shards the checkpoint "
                    "was made with"
                )
        finally:
            stream.close()


class Loader(_TorchdataLoader):  # type: ignore[type-arg]
    """torchdata's ``Loader``, whose ``state_dict()`` stays true after a resume at an epoch's end.

    torchdata 0.11's ``Loader``, restored from a state taken after an epoch's last item, looks
    ahead, finds the epoch over and starts the next one, but keeps the state it cached before
    looking: every ``state_dict()`` the resumed job takes from then on, epochs later, is that
    epoch's end, and a job resumed from one trains again everything since (found by review,
    2026-12-06; upstream meta-pytorch/data#1552, not merged). This subclass forgets the cached
    state whenever its iterator starts over. Use it wherever ``torchdata.nodes.Loader`` is used
    (same arguments, same states: either loads the other's)."""

    def __iter__(self) -> Any:
        if getattr(self, "_it", None) is None:
            self._it = _MendedIterator(self)
        return super().__iter__()


class _MendedIterator(_TorchdataLoaderIterator):  # type: ignore[type-arg]
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        # the state cached by a look-ahead that found the restored epoch over is not this pass's
        self._cached_state_dict = None
