"""A compact memory of each sample's last known loss, so later epochs can sift without a forward pass.

InfoBatch's trick in a streaming pipeline: the training step computes every kept sample's loss
anyway; handed back with ``Sifter.observe(keys, losses)``, those losses decide the sample's fate
next epoch with no scoring forward. The memory is an open-addressing hash table in numpy, keyed by
a stable 64-bit hash of the sample key: 16 bytes a slot, at most 70% full, so about 23 bytes per
sample it can hold. It is bounded (``capacity`` samples; further new keys are refused and counted),
part of the stage's state, and can be saved next to the audit log and published to DataLoader
workers for sifting before decode.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import secrets as _random
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from .._secrets import redact, redact_url, refuse_credentials_in_url, secret_values
from ..errors import ConfigError, MissingKeyError, ResumeError
from .exactsum import ExactSum
from .files import RETRY_TIMEOUT, check_retry_timeout, put_whole, retrying, storage_error
from .history import check_fits
from .hostcopy import HostCopy
from .values import is_int, scalar_key, short_repr
from .vocab import SOURCES

__all__ = ["SOURCES", "Keys", "ScoreMemory", "key_hashes", "pick_keys"]

#: Sample keys: a sequence (of str, or anything whose str() names the sample), or an integer array.
Keys = Sequence[Any] | np.ndarray

FORWARD, FEEDBACK, STALE, PROXY, NONE = (
    SOURCES.index(s) for s in ("forward", "feedback", "stale", "proxy", "none")
)

_EMPTY = np.uint64(0)
# where each slot's entry came from (``ScoreMemory._mark``): stored here and handed to other ranks
# (or never to be: a single process), stored here and not handed on yet, or sent by another rank
_SENT, _UNSENT, _MERGED = 0, 1, 2
# handed out by ``changes`` and not yet confirmed by ``mark_synced``: an update in between marks
# the slot _UNSENT again, so that what a loss-logging thread stored while the ranks exchanged
# theirs is sent next time (found by review, 2026-12-06: it was marked sent, never sent)
_SENDING = 3
_MAX_LOAD = 0.7
# a loss below this counts as below 0 (``below_zero``): a cross-entropy's rounding (log-softmax of
# a confident prediction a few ulps above 0, about -1e-6 at float32) is 0, not a negative loss
_BELOW_ZERO = -1e-4
_MAX_PROBES = 4096


_MAX_EPOCH = int(np.iinfo(np.int16).max)
_CACHED_KEY_TYPES = {str, np.str_}  # key types whose dict equality is equality of str(key)


def check_epoch(epoch: int) -> None:
    """``ConfigError`` unless ``epoch`` fits the memory's 16-bit epoch column."""
    if not -_MAX_EPOCH <= epoch <= _MAX_EPOCH:
        raise ConfigError(
            f"the score memory records epochs as 16-bit numbers, so epoch {epoch} is out of its range "
            f"(|epoch| <= {_MAX_EPOCH}); number epochs from 0 (set_epoch)"
        )


# key types whose text is str(key) as it is (no 0-d tensor to unwrap, never None): the fast path
_TEXT_IS_STR = {int, float, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8}


def publication_checksum(meta: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of a publication's ``latest.json`` fields, its ``sha256`` left out: the
    same for the dict ``publish`` wrote and for the one a reader parsed back (JSON keeps floats
    exactly; keys sorted)."""
    fields = {name: value for name, value in meta.items() if name != "sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _below(losses: np.ndarray) -> int:
    """How many of ``losses`` are below 0 by more than rounding (``_BELOW_ZERO``)."""
    return int(np.count_nonzero(losses < _BELOW_ZERO))


def key_hashes(keys: Iterable[Any]) -> np.ndarray:
    """Stable 64-bit hashes (BLAKE2b) of sample keys, the same in every process and run; never 0."""
    blake = hashlib.blake2b
    text = [k if type(k) is str else str(k) if type(k) in _TEXT_IS_STR else _key_text(k) for k in keys]
    # one bytes object of 8-byte digests read as little-endian integers: the same values as
    # int.from_bytes(digest, "little") per key, without a Python int per key
    try:
        digests = b"".join([blake(t.encode(), digest_size=8).digest() for t in text])
    except UnicodeEncodeError:
        # a key with a lone surrogate (a tar member's name that was not valid UTF-8, as Python
        # decodes it): its own bytes, where it raised a bare UnicodeEncodeError (found by review,
        # 2026-12-06); valid text encodes as before, so no stored hash moves
        digests = b"".join([blake(t.encode("utf-8", "surrogatepass"), digest_size=8).digest() for t in text])
    out = np.frombuffer(digests, dtype="<u8").astype(np.uint64)  # a writable copy, native order
    out[out == _EMPTY] = 1  # 0 marks an empty slot
    return out


def check_memory_state(memory: Any, bad: Callable[[str, str], ResumeError]) -> None:
    if memory is None:
        return
    if not isinstance(memory, Mapping):
        raise bad("memory", "None or a dict")
    if not is_int(memory.get("capacity"), 1):
        raise bad("memory['capacity']", "an integer >= 1")
    if memory.get("max_age") is not None and not is_int(memory.get("max_age"), 1):
        raise bad("memory['max_age']", "an integer >= 1, or None (never expires)")
    if "drift" in memory and not (
        isinstance(memory["drift"], torch.Tensor)
        and memory["drift"].shape == (2, 2, 2)
        and bool(torch.isfinite(memory["drift"]).all())
        and is_int(memory.get("drift_epoch"), -32767)
        and (
            memory.get("drift_verdict") is None
            or (isinstance(memory["drift_verdict"], float | int) and np.isfinite(memory["drift_verdict"]))
        )
    ):
        raise bad("memory['drift']", "a finite 2x2x2 tensor with an integer drift_epoch")
    if "hard" in memory and not (
        isinstance(memory["hard"], torch.Tensor)
        and memory["hard"].shape == (2, 2)
        and bool(torch.isfinite(memory["hard"]).all())
        and bool((memory["hard"] >= 0).all())
        and bool((memory["hard"][:, 1] <= memory["hard"][:, 0]).all())
    ):
        raise bad("memory['hard']", "a finite 2x2 tensor of counts (losses, hard ones among them) >= 0")
    verdict = memory.get("hard_verdict")
    if verdict is not None and not (
        isinstance(verdict, float | int) and not isinstance(verdict, bool) and 0.0 <= verdict <= 1.0
    ):
        raise bad("memory['hard_verdict']", "None or a share in [0, 1]")
    means = memory.get("drift_mean")
    if means is not None and not (
        isinstance(means, list | tuple)
        and len(means) == 2
        and all(m is None or (isinstance(m, float | int) and np.isfinite(m)) for m in means)
    ):
        raise bad("memory['drift_mean']", "two finite numbers or None")
    if not is_int(memory.get("refused")):
        raise bad("memory['refused']", "a count >= 0")
    if "repeated" in memory and not is_int(memory["repeated"]):
        raise bad("memory['repeated']", "a count >= 0")
    if "applied" in memory and not is_int(memory["applied"]):
        raise bad("memory['applied']", "a count >= 0")
    spread = memory.get("spread")
    if spread is not None and not (isinstance(spread, float | int) and np.isfinite(spread) and spread >= 0):
        raise bad("memory['spread']", "None or a finite number >= 0")
    if memory.get("spread_at") is not None and not is_int(memory["spread_at"]):
        raise bad("memory['spread_at']", "None or a count >= 0")
    dtypes = {"keys": torch.int64, "loss": torch.float32, "epoch": torch.int16, "source": torch.int8}
    sizes = set()
    for name, dtype in dtypes.items():
        t = memory.get(name)
        if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.ndim == 1):
            raise bad(f"memory[{name!r}]", f"a 1-d {dtype} tensor")
        sizes.add(t.shape[0])
    for name in ("unsynced", "merged"):  # states written before sync_memory lack them
        t = memory.get(name)
        if t is not None:
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.ndim == 1):
                raise bad(f"memory[{name!r}]", "a 1-d bool tensor")
            sizes.add(t.shape[0])
    if len(sizes) != 1:
        raise bad("memory", f"tensors of one length (got lengths {sorted(sizes)})")
    if not bool(torch.isfinite(memory["loss"]).all()):
        raise bad("memory['loss']", "finite losses (a remembered loss is never NaN or infinite)")
    if memory["epoch"].numel() and int(memory["epoch"].to(torch.int32).abs().max()) > _MAX_EPOCH:
        # (-32768 fits the int16 column and no epoch the memory records: refused here, before
        # anything is loaded, not halfway through filling the table)
        raise bad("memory['epoch']", f"epochs within +-{_MAX_EPOCH}")
    if sizes.pop() > memory["capacity"]:
        raise bad("memory['keys']", f"at most capacity={memory['capacity']} entries")


def _check_pairs(keys: Keys, n: int) -> None:
    """``ConfigError`` unless ``keys`` holds one key per loss of ``n``: a 1-d array or a sequence
    (a (B, 1) array of integer keys was stored, then broke the key cache, and applied twice)."""
    if isinstance(keys, np.ndarray) and keys.ndim != 1:
        raise ConfigError(
            f"the score memory got keys as an array of shape {keys.shape}; pass one key per loss, "
            "a 1-d array or a list (keys.ravel())"
        )
    if len(keys) != n:
        raise ConfigError(
            f"the score memory got {len(keys)} keys for {n} losses; pass one loss per key (reduction='none')"
        )


def _distinct_keys(hashes: np.ndarray) -> bool:
    """Whether stored key hashes (a state's, a file's) are distinct and none is the empty-slot 0."""
    return bool(hashes.all()) and np.unique(hashes).size == hashes.size


def _key_text(key: Any) -> str:
    """A key that is not a str, as text (a 0-d tensor as its value: ``scalar_key``); None is
    refused (every such sample would share one loss)."""
    key = scalar_key(key)
    if key is None:
        raise MissingKeyError(
            "a sample's key is None: the score memory would give every such sample one loss. Give "
            "each sample a key (WebDataset's '__key__', or key=<field or callable>)"
        )
    return str(key)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[ScoreMemory, _P], _R]) -> Callable[Concatenate[ScoreMemory, _P], _R]:
    """``method`` run holding the memory's lock (see ``ScoreMemory``: several threads)."""

    @functools.wraps(method)
    def run(self: ScoreMemory, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class ScoreMemory:
    """The last known loss of up to ``capacity`` samples, by key.

    Args:
        capacity: Samples it can hold (about 23 bytes each, allocated up front).
        max_age: A remembered loss decides a sample for this many epochs after it was recorded
            (1: the next epoch only; k: Selective Backprop's stale mode). Older ones are re-scored.
            ``None``: it never expires (InfoBatch: a pruned sample keeps its last loss until it is
            trained again).
        key_cache: String keys whose place in the table it remembers, at most: the first this
            many distinct keys stored, about 150 bytes each (the key, its slot, a dict entry); 0:
            none. Integer keys given as an array (``batch["__key__"]`` a tensor of dataset
            indices) in [0, key_cache) are remembered in an array of 8 bytes per value instead,
            grown as larger keys are stored, and found for a whole batch at once. Hashing a key and
            probing the table for it costs about 1 µs, a cached string key about 0.15 µs: over
            several epochs of the same keys that is most of the stage's cost per sample on a cheap
            training step. ``lookup_keys``, ``update_keys`` and ``hashes`` use it; the cache is
            not part of the state (a key's slot never changes until the table is refilled, which
            empties it).

    One memory may be used from several threads (two sifters sharing it, each in its own thread,
    or ``observe`` called from a loss-logging thread): its reads and updates hold a lock (until
    2026-12-06 two inserts at once could claim one slot, and a key held another's loss).

    Besides losses, the memory measures what dropping did (see ``forgetting``): when the training
    step hands back the loss of a sample whose remembered loss is two or more epochs old (it was
    not trained in between), the change is compared with that of easy samples that were trained
    (easy: below the mean remembered loss when the epoch being observed began). The figure does
    not depend on how the training losses are grouped into updates: a checkpoint or a read that
    applies deferred losses early changes nothing the stage decides later.
    """

    def __init__(
        self, capacity: int = 1_000_000, max_age: int | None = 1, *, key_cache: int = 1 << 17
    ) -> None:
        if not isinstance(capacity, int | np.integer) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigError(f"capacity must be a number of samples >= 1, got {capacity!r}")
        if max_age is not None and (
            not isinstance(max_age, int | np.integer) or isinstance(max_age, bool) or max_age < 1
        ):
            raise ConfigError(
                f"max_age must be a number of epochs >= 1 or None (never expires), got {max_age!r}"
            )
        if not isinstance(key_cache, int | np.integer) or isinstance(key_cache, bool) or key_cache < 0:
            raise ConfigError(f"key_cache must be a number of keys >= 0, got {key_cache!r}")
        capacity, key_cache = int(capacity), int(key_cache)
        max_age = None if max_age is None else int(max_age)
        self._lock = threading.RLock()
        self.capacity = capacity
        self.max_age = max_age
        self.key_cache = key_cache
        # str key -> the slot holding its hash: keys never move (nothing is deleted) until _fill
        # empties the table, and the cache with it
        self._slot_of: dict[str, int] = {}
        self._slot_of_int: np.ndarray | None = None  # the same for integer keys, by value
        slots = max(16, int(np.ceil(capacity / _MAX_LOAD)))
        fix = "size it to the samples of one epoch (or of this rank's shards)"
        check_fits(16 * slots, f"a score memory of capacity {capacity:,} (about 23 bytes a sample)", fix)
        self._slots_n = np.uint64(slots)
        try:
            self._keys = np.zeros(slots, dtype=np.uint64)
            self._loss = np.zeros(slots, dtype=np.float32)
            self._epoch = np.zeros(slots, dtype=np.int16)
            self._source = np.zeros(slots, dtype=np.int8)
            # per slot _SENT, _UNSENT (set here since the last ``mark_synced``: what ``changes``
            # hands to other ranks, ``siftpipe.sync_memory``) or _MERGED (another rank's)
            self._mark = np.zeros(slots, dtype=np.int8)
        except MemoryError:
            raise ConfigError(
                f"a score memory of capacity {capacity:,} does not fit in memory; {fix}"
            ) from None
        self._count = 0
        self._sum = ExactSum()  # of every remembered loss, for ``mean``
        self._below_zero = 0  # remembered losses below 0 (``below_zero``)
        self._refused = 0
        self._repeated = 0
        # losses handed over with defer_keys, applied in order at the next read (see flush)
        self._deferred: list[tuple[Keys, np.ndarray | HostCopy, int, int]] = []
        self._deferred_rows = 0
        # the files publish() wrote, per publication URL, oldest first (pruned to its keep=)
        self._published: dict[str, list[str]] = {}
        #: Seconds spent waiting for losses copied from a CUDA device (``HostCopy``) to arrive: the
        #: training step's kernels finishing, not the memory's work
        self.waited = 0.0
        # forgetting evidence: rows (skipped, trained easy) x (sum of loss change, count), for the
        # epoch being observed (_drift[0]) and the one before it (_drift[1])
        self._drift = np.zeros((2, 2, 2))
        self._drift_epoch = 0
        # the mean remembered loss when the epoch being observed (and the one before) began: a
        # sample is "easy then" against it, so no grouping of updates changes the evidence
        self._drift_mean = np.full(2, np.nan)
        self._verdict = float("nan")  # the last forgetting measured over a whole epoch
        # persistently hard samples: per epoch window (as _drift), the training losses of known
        # samples (trained in an earlier epoch) and how many of them were, like the remembered one,
        # above HARD_MULTIPLE x the mean when the epoch began; and the last whole epoch's share
        self._hard = np.zeros((2, 2))
        self._hard_verdict = float("nan")
        self._applied = 0  # losses applied in all (for when ``spread`` is measured again)
        self._spread = float("nan")  # the last ``spread`` measured, NaN if none or undefined
        self._spread_at: int | None = None  # ``_applied`` when it was measured
        # (``_applied``, spread) as ``spread()`` last measured it for a reader: apart from the
        # policy's measure, so that reading it changes nothing the stage decides
        self._read_spread: tuple[int, float] | None = None
        #: Whether ``siftpipe.sync_memory`` has warned that other ranks' losses did not fit.
        self.warned_full_sync = False

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            state = self.__dict__.copy()
        del state["_lock"]  # (a lock does not pickle; a copy has its own)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        if "_below_zero" not in state:  # (pickled before it was counted)
            self._below_zero = _below(self._loss[self._keys != _EMPTY])

    @property
    def refused(self) -> int:
        """New keys turned away because the memory was full."""
        self.flush()
        return self._refused

    @property
    def repeated(self) -> int:
        """Losses that replaced one the same key got the same way (training losses, scoring
        forwards) earlier in the same epoch: two samples sharing a key (shards numbered from 0
        each, say), or one sample read twice in a pass (a stream that samples with replacement).
        The memory keeps the last, and next epoch decides every sample of that key by it."""
        self.flush()
        return self._repeated

    def __len__(self) -> int:
        self.flush()
        return self._count

    #: Losses ``defer_keys`` lets wait before it applies them itself.
    DEFER_ROWS = 8192

    @_locked
    def defer_keys(self, keys: Keys, losses: np.ndarray | HostCopy, epoch: int, source: int) -> None:
        """``update_keys(keys, losses, epoch, source)``, applied later: before the memory is next
        read (a look-up, ``mean``, ``len``, the counters, the state, a file, any update) or once
        ``DEFER_ROWS`` losses wait, in the order they came, one ``update_keys`` per run of one
        epoch and source. ``Sifter.observe`` hands the training step's losses over so: the
        stage reads the memory once per input batch, so the losses of the several training
        steps one input batch feeds are applied in one go, for the cost of one (each call costs
        a few dozen numpy operations, whatever its size). Keys and losses are copied: a batch's
        buffers may be reused after the call. ``losses`` may be a ``HostCopy`` still on its way
        from a CUDA device: it is waited for when applied (``waited`` counts those seconds).
        ``forgetting()`` reports what has been applied."""
        keys = keys.copy() if isinstance(keys, np.ndarray) else list(keys)
        if not isinstance(losses, HostCopy):
            losses = np.array(losses, dtype=np.float32).reshape(-1)
        _check_pairs(keys, losses.size)  # here, not when applied: then it would lose the hand-over
        self._deferred.append((keys, losses, epoch, source))
        self._deferred_rows += losses.size
        if self._deferred_rows >= self.DEFER_ROWS:
            self.flush()

    def flush(self) -> None:
        """Apply the losses ``defer_keys`` holds (every read does this first)."""
        if not self._deferred:
            return
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        deferred = self._deferred
        if not deferred:
            return
        self._deferred, self._deferred_rows = [], 0
        try:
            arrived = [self._arrived(r) for r in deferred]
        except BaseException:
            self._requeue(deferred)  # still copies on their way (those that arrived return at once)
            raise
        start = 0
        while start < len(arrived):
            epoch, source = arrived[start][2], arrived[start][3]
            stop = start + 1
            while stop < len(arrived) and arrived[stop][2] == epoch and arrived[stop][3] == source:
                stop += 1
            try:
                self.update_keys(*_joined(arrived[start:stop]), epoch, source)
            except Exception:
                # hand by hand: what can be applied is, the hand-over that cannot is dropped with
                # this error, and what came after it waits for the next read (nothing else lost)
                for at in range(start, stop):
                    try:
                        self.update_keys(*arrived[at])
                    except BaseException:
                        self._requeue(list(arrived[at + 1 :]))
                        raise
            except BaseException:  # interrupted: all of this run and after waits
                self._requeue(list(arrived[start:]))
                raise
            start = stop

    def _arrived(self, handed: tuple[Keys, Any, int, int]) -> tuple[Keys, np.ndarray, int, int]:
        """A deferred hand-over with its losses on the host (waiting for a ``HostCopy``)."""
        losses = handed[1]
        if not isinstance(losses, HostCopy):
            return handed
        before = losses.waited
        values = losses.result()
        self.waited += losses.waited - before
        return (handed[0], values, handed[2], handed[3])

    def _requeue(self, waiting: list[tuple[Keys, Any, int, int]]) -> None:
        self._deferred = waiting + self._deferred
        self._deferred_rows = sum(r[1].size for r in self._deferred)

    @_locked
    def usable_at(self, epoch: int) -> int:
        """Keys whose loss a look-up in ``epoch`` can use: stored in an earlier epoch (a loss is not
        used in the epoch it was stored in) and at most ``max_age`` epochs before. One pass over
        the table."""
        self.flush()
        if not self._count:
            return 0
        return int(np.count_nonzero(self._usable(self._epoch, epoch) & (self._keys != _EMPTY)))

    @_locked
    def newest_epoch(self) -> int | None:
        """The latest epoch any remembered loss was stored in; None when empty. One pass over
        the table."""
        self.flush()
        if not self._count:
            return None
        return int(self._epoch[self._keys != _EMPTY].max())

    def _usable(self, stored: np.ndarray, epoch: int) -> np.ndarray:
        """Whether losses stored in epochs ``stored`` may decide in ``epoch``: stored before it
        (never in the epoch being decided) and at most ``max_age`` epochs before."""
        age = epoch - stored.astype(np.int64)
        usable = age >= 1
        if self.max_age is not None:
            usable &= age <= self.max_age
        return usable

    @property
    def nbytes(self) -> int:
        """Bytes held by the table."""
        return (
            self._keys.nbytes
            + self._loss.nbytes
            + self._epoch.nbytes
            + self._source.nbytes
            + self._mark.nbytes
        )

    def _cached_slots(self, keys: Keys) -> np.ndarray | None:
        """The cached slot of each key, -1 where there is none; None unless the cache is on and
        the keys are all str (or numpy str), or an integer numpy array."""
        if not self.key_cache or not len(keys):
            return None
        if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
            # integer keys (a map-style dataset's indices): one array read for the whole batch
            table = self._slot_of_int
            if table is None:
                return np.full(keys.size, -1, dtype=np.int64)
            if keys.min() >= 0 and keys.max() < table.size:
                return table[keys]
            inside = (keys >= 0) & (keys < table.size)
            slots = np.full(keys.size, -1, dtype=np.int64)
            slots[inside] = table[keys[inside]]
            return slots
        # str (and numpy's str) only: 1, 1.0 and True are one dict key but three different strings,
        # and a str subclass may str() to something else
        if not set(map(type, keys)) <= _CACHED_KEY_TYPES:
            return None
        return np.fromiter(map(self._slot_of.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def _int_table(self, largest: int) -> np.ndarray:
        """The slot of each integer key by value (-1: not known), grown to hold ``largest`` (at
        most ``key_cache`` values: 8 bytes for each value up to the largest key cached)."""
        table = self._slot_of_int
        if table is None or table.size <= largest:
            size = min(self.key_cache, max(1024, 2 * (largest + 1)))
            grown = np.full(size, -1, dtype=np.int64)
            if table is not None:
                grown[: table.size] = table
            self._slot_of_int = table = grown
        return table

    def _remember_slots(self, keys: Keys, index: np.ndarray, hashes: np.ndarray) -> None:
        """Cache the slots of ``keys[index]`` (whose hashes are ``hashes``) that the table holds."""
        if not index.size:
            return
        if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
            slot = self._slots(hashes)
            held = self._keys[slot] == hashes
            picked = keys[index]
            held &= (picked >= 0) & (picked < self.key_cache)
            if held.any():
                values = picked[held]
                self._int_table(int(values.max()))[values] = slot[held]
            return
        room = self.key_cache - len(self._slot_of)
        if room <= 0:
            return
        slot = self._slots(hashes)
        held = np.flatnonzero(self._keys[slot] == hashes)[:room]
        if held.size:
            picked = index[held].tolist()
            self._slot_of.update(zip([keys[i] for i in picked], slot[held].tolist()))

    def hashes(self, keys: Keys) -> np.ndarray:
        """``key_hashes(keys)``, read from the table for string keys whose slot is cached."""
        slots = self._cached_slots(keys)
        return key_hashes(keys) if slots is None else self._hashes_at(keys, slots)

    def _hashes_at(self, keys: Keys, slots: np.ndarray) -> np.ndarray:
        """The keys' hashes: read from the table at their cached ``slots``, computed where -1."""
        out = self._keys[slots]  # a copy; rows of -1 are replaced below
        miss = np.flatnonzero(slots < 0)
        if miss.size:
            out[miss] = key_hashes(pick_keys(keys, miss))
        return out

    def _slots(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash: the slot holding it, or the empty slot where it would go."""
        mixed = hashes ^ (hashes >> np.uint64(29))
        slot = (mixed % self._slots_n).astype(np.int64)
        here = self._keys[slot]
        done = (here == hashes) | (here == _EMPTY)
        if np.count_nonzero(done) == hashes.size:  # the common case: every first probe answers
            return slot
        found = np.where(done, slot, -1)
        pending = np.flatnonzero(~done)
        slot[pending] = (slot[pending] + 1) % int(self._slots_n)
        for _ in range(_MAX_PROBES):
            here = self._keys[slot[pending]]
            done = (here == hashes[pending]) | (here == _EMPTY)
            found[pending[done]] = slot[pending[done]]
            pending = pending[~done]
            if not pending.size:
                return found
            slot[pending] = (slot[pending] + 1) % int(self._slots_n)
        raise RuntimeError("score memory probe limit reached; the table is corrupt")

    @_locked
    def update(self, hashes: np.ndarray, losses: np.ndarray, epoch: int, source: int) -> None:
        """Remember ``losses`` for ``hashes`` (the last value wins for a repeated key)."""
        self.flush()
        check_epoch(epoch)
        losses = np.asarray(losses, dtype=np.float32)
        hashes = np.asarray(hashes, np.uint64)
        _check_pairs(hashes, losses.size)
        finite = np.isfinite(losses)
        hashes, losses = hashes[finite], losses[finite]
        if not hashes.size:
            return
        self._applied += hashes.size
        if source == FEEDBACK:
            self._drift_to(epoch)
        # the last occurrence of each key in this batch wins; the keys are taken in the order of
        # their first occurrence, as updates applied one at a time would take them: a memory that
        # fills up keeps the same keys however deferred updates were grouped (a checkpoint's read
        # applies them early; found by review, 2026-12-05: in hash order it kept others)
        _, first_at = np.unique(hashes, return_index=True)
        moved = None  # the losses a known key's forgetting evidence is read from: its stored ones
        occurrences = None  # of each key, where a key came more than once
        if first_at.size < hashes.size:
            _, last, counts = np.unique(hashes[::-1], return_index=True, return_counts=True)
            order = np.argsort(first_at, kind="stable")
            keep = (hashes.size - 1 - last)[order]
            occurrences = counts[order]
            self._repeated += hashes.size - first_at.size
            if source == FEEDBACK:
                # a key's first loss meets the remembered one, as it would applied on its own (the
                # later ones would meet this epoch's): the same evidence however updates are grouped
                moved = losses[first_at[order]]
            hashes, losses = hashes[keep], losses[keep]
        while hashes.size:
            slot = self._slots(hashes)
            present = self._keys[slot] == hashes
            if present.any():
                if source == FEEDBACK:
                    drift = losses if moved is None else moved
                    self._note_drift(slot[present], drift[present], epoch)
                else:
                    self._repeated += self._rescored(slot[present], epoch, source)
            self._set(slot[present], hashes[present], losses[present], epoch, source)
            hashes, losses, slot = hashes[~present], losses[~present], slot[~present]
            if occurrences is not None:
                occurrences = occurrences[~present]
            if moved is not None:
                moved = moved[~present]
            room = self.capacity - self._count
            if hashes.size > room:
                # more new keys than room: the first to come are taken, each occurrence of the
                # rest refused (none of them replaced a remembered loss: no repeat), as one at a
                # time would have it
                if occurrences is None:
                    self._refused += hashes.size - room
                else:
                    refused = occurrences[room:]
                    self._refused += int(refused.sum())
                    self._repeated -= int(refused.sum()) - refused.size
                    occurrences = occurrences[:room]
                hashes, losses, slot = hashes[:room], losses[:room], slot[:room]
                if moved is not None:
                    moved = moved[:room]
            if not hashes.size:
                return
            first = self._claim(slot)
            self._set(slot[first], hashes[first], losses[first], epoch, source)
            self._count += first.size
            rest = np.ones(hashes.size, dtype=bool)
            rest[first] = False
            hashes, losses = hashes[rest], losses[rest]
            if occurrences is not None:
                occurrences = occurrences[rest]
            if moved is not None:
                moved = moved[rest]

    def _claim(self, slot: np.ndarray) -> np.ndarray:
        """Which of the new keys probing to the empty slots ``slot`` take them now: two racing for
        one slot, the first (the rest probe on in the next round). The caller has refused the
        keys there is no room for."""
        _, first = np.unique(slot, return_index=True)
        return np.sort(first)

    def _rescored(self, slot: np.ndarray, epoch: int, source: int) -> int:
        """Held keys at ``slot`` scored again in the epoch they were scored in, the same way
        (``source``, not feedback): each such key came twice in the epoch."""
        return int(
            np.count_nonzero(
                (self._epoch[slot] == epoch) & (self._source[slot] == source) & (self._mark[slot] != _MERGED)
            )
        )

    def _drift_to(self, epoch: int) -> None:
        """Training losses of ``epoch`` are about to be applied: move the forgetting evidence on
        to it if it is a newer epoch than the one observed (before anything of it is applied, so
        the mean it starts from does not depend on how its updates are grouped)."""
        if epoch <= self._drift_epoch:
            # this epoch, or a late hand-over of the one before (see _note_drift); or of an epoch
            # older still, whose losses are no evidence of anything now: the window stays (moved
            # back to it, the next loss of this epoch began the epoch again, mid-pass, and the
            # evidence gathered so far was lost; found by review, 2026-12-05)
            return
        if epoch > self._drift_epoch:
            verdict = self._forgetting_of(self._drift[0])
            if verdict is not None:
                self._verdict = verdict
            hard = self._hard_share_of(self._hard[0])
            if hard is not None:
                self._hard_verdict = hard
            follows = epoch == self._drift_epoch + 1
            self._drift[1] = self._drift[0] if follows else 0.0
            self._drift[0] = 0.0
            self._hard[1] = self._hard[0] if follows else 0.0
            self._hard[0] = 0.0
            self._drift_mean[1] = self._drift_mean[0] if follows else np.nan
            self._drift_mean[0] = self._mean()
        self._drift_epoch = epoch

    def _note_drift(
        self, slot: np.ndarray, losses: np.ndarray, epoch: int, old: np.ndarray | None = None
    ) -> None:
        """Record how the training losses of known samples moved since they were remembered, and
        count those that replace a training loss of this same epoch (``repeated``). ``old``: the
        losses at ``slot``, if the caller has read them. ``_drift_to(epoch)`` came first."""
        # 1: a late hand-over, the last batches of the pass before, trained after this pass began
        # (a trainer that fetches ahead; Sifter.observe(epoch=...)): evidence of that epoch
        window = 1 if epoch == self._drift_epoch - 1 else 0
        if epoch < self._drift_epoch - 1:
            # older still: no evidence of this epoch or the last; a repeat all the same
            repeat = (self._epoch[slot] == epoch) & (self._source[slot] == FEEDBACK)
            repeat &= self._mark[slot] != _MERGED
            self._repeated += int(np.count_nonzero(repeat))
            return
        if old is None:
            old = self._loss[slot]
        # int32: two 16-bit epochs can be 65,534 apart
        age = np.subtract(epoch, self._epoch[slot], dtype=np.int32)
        # one code per row: 1 skipped (not trained for an epoch or more), 2 trained last epoch and
        # easy then, 3 a training loss of this same epoch already (the key came twice), 0 other
        kind = (age >= 2).view(np.int8)
        # easy then: below the mean when the epoch began (NaN before any: nothing is easy)
        kind = kind + 2 * ((age == 1) & (old < self._drift_mean[window]))  # compared as float64
        repeat = (age == 0) & (self._source[slot] == FEEDBACK)
        if repeat.any():  # rare: read the marks only then (a loss another rank trained, merged,
            repeat &= self._mark[slot] != _MERGED  # and trained here too is no repeat here)
        kind += 3 * repeat
        counts = np.bincount(kind, minlength=4)
        if counts[3]:
            self._repeated += int(counts[3])
        # hard then and hard now, against the mean when the epoch began (NaN: none is hard)
        # (a mean at or below 0, or NaN: no line; twice a negative mean is below every loss)
        start = self._drift_mean[window]
        line = self.HARD_MULTIPLE * start if start > 0 else np.nan
        before = age >= 1
        hard = self._hard[window]
        hard[0] += np.count_nonzero(before)
        hard[1] += np.count_nonzero((old > line) & (losses > line) & before)
        if counts[1] or counts[2]:
            sums = np.bincount(kind, weights=np.subtract(losses, old, dtype=np.float64), minlength=4)
            drift = self._drift[window]
            drift[0, 0] += sums[1]
            drift[0, 1] += counts[1]
            drift[1, 0] += sums[2]
            drift[1, 1] += counts[2]

    @_locked
    def forgetting(self) -> float | None:
        """How much more the loss of samples that were not trained rose than that of easy samples
        that were, in units of the mean remembered loss (0: dropping cost nothing; 0.5: dropped
        samples came back half a mean loss worse). Measured over the epoch before the one being
        observed, else over this one so far (each needs ``MIN_EVIDENCE`` samples of both kinds),
        else the last whole epoch's figure; None before any evidence. Losses ``defer_keys`` still
        holds are not in it yet (the stage applies them before each decision)."""
        for window in (self._drift[1], self._drift[0]):
            value = self._forgetting_of(window)
            if value is not None:
                return value
        return None if np.isnan(self._verdict) else self._verdict

    #: Samples of each kind (skipped, trained easy) a forgetting figure needs.
    MIN_EVIDENCE = 16

    #: A loss this many times the mean remembered loss (when its epoch began) is *hard* for
    #: ``persistent_hard``.
    HARD_MULTIPLE = 2.0
    #: Training losses of known samples a ``persistent_hard`` share needs.
    MIN_HARD_EVIDENCE = 256

    @_locked
    def persistent_hard(self) -> float | None:
        """The share of training losses handed back for samples trained in an earlier epoch that
        were, like the loss remembered for that sample, above ``HARD_MULTIPLE`` (2) times the mean
        remembered loss when the epoch began: samples the model keeps getting wrong, as a
        mislabeled sample stays. Measured over the epoch before the one being observed, else
        this one so far (``MIN_HARD_EVIDENCE`` losses at least), else the last whole epoch's
        figure; None before any evidence. On siftpipe's benchmark suite (docs/benchmarks.md),
        after the last of 8 epochs, it was at most 0.11 on tasks with clean labels (0.02 on the
        redundant task, 0 on the language model) and 0.20-0.25 on classification tasks with 20%
        of the labels wrong; like ``forgetting`` it does not depend on how losses are grouped
        into updates. None while remembered losses are below 0 (``below_zero``): twice a mean
        of losses of both signs says nothing (it called half of a clean dataset mislabeled; found
        by review, 2026-12-06)."""
        if self._below_zero:
            return None
        for window in (self._hard[1], self._hard[0]):
            value = self._hard_share_of(window)
            if value is not None:
                return value
        return None if np.isnan(self._hard_verdict) else self._hard_verdict

    def _hard_share_of(self, window: np.ndarray) -> float | None:
        known, hard = window
        if known < self.MIN_HARD_EVIDENCE:
            return None
        return float(hard / known)

    def _forgetting_of(self, window: np.ndarray) -> float | None:
        mean = self._mean()
        (s_sum, s_n), (t_sum, t_n) = window
        if not mean > 0 or self._below_zero or s_n < self.MIN_EVIDENCE or t_n < self.MIN_EVIDENCE:
            return None
        return float((s_sum / s_n - t_sum / t_n) / mean)

    #: ``spread`` is measured again once losses numbering 1 / SPREAD_PERIOD of the memory's size
    #: have been applied since it last was.
    SPREAD_PERIOD = 4

    @_locked
    def spread(self) -> float | None:
        """How far the remembered losses sit below their mean, on average over every remembered
        loss, in units of the mean: ``mean(max(0, mean - loss)) / mean``. 0 when every loss equals
        the mean (nothing tells samples apart); about 0.37 for exponentially distributed losses;
        near 1 when most are near 0 and a few are large. It is the share of samples
        ``InfoBatch(graded=True)`` prunes at ratio 1. None when the memory is empty or its mean is
        not > 0. Measured again once a quarter of the memory's size of losses has been applied
        since the last measure (one sort of the memory's losses each time), so reading it is
        cheap. Reading it changes nothing the stage decides: the policy measures it on a
        schedule of its own (``measure_spread``; before 2026-12-05 a reader's measure moved the
        points the policy's spread floor was measured at, and so what it pruned: found by
        review)."""
        self.flush()
        if self._spread_at == self._applied:
            return self.measured_spread  # the policy measured the memory as it is now
        period = max(1, self._count // self.SPREAD_PERIOD)
        read = self._read_spread
        if read is None or not 0 <= self._applied - read[0] < period:
            read = self._read_spread = (self._applied, self._measure_spread())
        return None if np.isnan(read[1]) else read[1]

    @_locked
    def measure_spread(self) -> float | None:
        """``spread()`` as a policy reads it before it decides: measured again once a quarter of
        the memory's size of losses has been applied since the policy's last measure. A given
        sequence of updates and of these calls measures it at the same points and to the same
        bits (they are in the state), so a resumed stage decides as one never stopped; reads of
        ``spread()`` do not move them."""
        self.flush()
        if self._spread_at is None or self._applied - self._spread_at >= max(
            1, self._count // self.SPREAD_PERIOD
        ):
            self._spread = self._measure_spread()
            self._spread_at = self._applied
        return self.measured_spread

    @property
    def measured_spread(self) -> float | None:
        """``spread()`` as last measured (no flush, no new measure): for stats."""
        return None if np.isnan(self._spread) else self._spread

    def _measure_spread(self) -> float:
        if not self._count:
            return float("nan")
        loss = self.losses()  # (spread() has flushed)
        # sorted: the figure does not depend on where in the table each loss sits (a loaded
        # memory puts keys in other slots)
        loss.sort()
        mean = float(loss.mean())
        if not mean > 0:
            return float("nan")
        return float(np.maximum(mean - loss, 0.0).mean() / mean)

    @_locked
    def below_zero(self) -> int:
        """How many remembered losses are below 0, by more than rounding (below -1e-4: a
        log-likelihood, an ELBO): measures in units of the mean (``spread``, ``forgetting``,
        ``persistent_hard``) mean nothing then."""
        self.flush()
        return self._below_zero

    @_locked
    def mean(self) -> float:
        """The mean of every remembered loss (any age); NaN when empty."""
        self.flush()
        return self._mean()

    def _mean(self) -> float:
        """``mean()`` of what has been applied (no flush)."""
        return self._sum.mean(self._count)

    def _set(
        self,
        slot: np.ndarray,
        hashes: np.ndarray,
        losses: np.ndarray,
        epoch: int | np.ndarray,
        source: int | np.ndarray,
        *,
        mine: bool = True,
    ) -> None:
        """Store entries at ``slot``; ``mine``: this process's own (``changes`` hands them on),
        not entries another rank sent (``merge``)."""
        fresh = self._keys[slot] == _EMPTY
        old = self._loss[slot][~fresh]
        self._sum.change(losses, old)
        self._below_zero += _below(losses) - _below(old)
        self._keys[slot] = hashes
        self._loss[slot] = losses
        self._epoch[slot] = epoch
        self._source[slot] = source
        self._mark[slot] = _UNSENT if mine else _MERGED

    # ------------------------------------------------------------------ across ranks

    @_locked
    def changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The entries this process stored since the last ``mark_synced`` (its training losses
        and scoring forwards, not what ``merge`` brought): ``(hashes, losses, epochs, sources)``,
        uint64, float32, int16 and int8 arrays. What ``siftpipe.sync_memory`` sends to other ranks;
        they are being sent until ``mark_synced`` (``changes`` returns them again before it)."""
        self.flush()
        at = np.flatnonzero(self._unsent())
        self._mark[at] = _SENDING
        return self._keys[at], self._loss[at], self._epoch[at], self._source[at]

    @_locked
    def unsynced(self) -> int:
        """How many entries ``changes`` would return now (it marks them as being sent; this
        changes nothing)."""
        self.flush()
        return int(np.count_nonzero(self._unsent()))

    def _unsent(self) -> np.ndarray:
        """Which slots hold an entry stored here not yet confirmed sent (a bool per slot)."""
        return ((self._mark == _UNSENT) | (self._mark == _SENDING)) & (self._keys != _EMPTY)

    @_locked
    def mark_synced(self) -> None:
        """The entries the last ``changes`` returned have been handed on (it returns none of them
        again); one stored since, or stored again, is handed on next time."""
        self.flush()
        self._mark[self._mark == _SENDING] = _SENT

    @_locked
    def merge(
        self,
        hashes: np.ndarray,
        losses: np.ndarray,
        epochs: np.ndarray,
        sources: np.ndarray,
        *,
        now: int | None = None,
        sent: np.ndarray | None = None,
    ) -> int:
        """Take entries another rank stored (its ``changes()``). An entry replaces the one held
        for its key when it is newer: a later epoch; in the same epoch a training loss over a
        scoring forward's; then the larger loss, the larger source code, the larger bit pattern
        (so that every rank, merging the same entries in any order, ends holding the same one).
        A key not held takes a free slot while there is room; beyond ``capacity`` it is refused
        and counted in ``refused``. Nothing here is evidence of forgetting (``forgetting``
        measures this process's training losses), a merged entry replaced by this process's own
        loss in the same epoch is not counted in ``repeated``, and merged entries are not handed
        on again. Returns the entries stored.

        ``now``: the epoch this process is in. An entry from a later epoch of another process
        (processes whose passes do not end together, as the Hugging Face Trainer's) is stored as
        of the epoch before ``now``: a loss as recent as any this process holds, usable in its
        current pass (stored as of its own later epoch, it would be unusable here until then,
        and would replace a usable older loss).

        ``sent``: the hashes this process handed on in the same exchange (its ``changes()``
        then), so that exchanges inside an epoch (every so many steps) leave the ranks alike: a
        held entry of the entry's epoch whose key is not among them was stored before the last
        exchange, and every entry that came was stored since, so it replaces the held one
        whatever its loss (the rank that sent it holds it). Only entries stored since the last
        exchange on two ranks are ranked as above. ``None``: every held entry is ranked so."""
        self.flush()
        hashes = np.asarray(hashes, np.uint64).ravel()
        losses = np.asarray(losses, np.float32).ravel()
        epochs = np.asarray(epochs, np.int16).ravel()
        sources = np.asarray(sources, np.int8).ravel()
        if now is not None:
            check_epoch(now)
        if not hashes.size == losses.size == epochs.size == sources.size:
            raise ConfigError(
                f"merge needs as many losses, epochs and sources as keys, got {hashes.size}, "
                f"{losses.size}, {epochs.size} and {sources.size}"
            )
        ok = np.isfinite(losses) & (hashes != _EMPTY)
        if not ok.all():
            hashes, losses, epochs, sources = hashes[ok], losses[ok], epochs[ok], sources[ok]
        if not hashes.size:
            return 0
        # one entry per key: the best of those that came (the last after sorting by rank)
        order = np.lexsort((losses.view(np.uint32), sources, losses, sources == FEEDBACK, epochs, hashes))
        ordered = hashes[order]
        best = order[np.append(ordered[1:] != ordered[:-1], True)]
        hashes, losses, epochs, sources = hashes[best], losses[best], epochs[best], sources[best]
        # compared as sent (a later epoch is newer), stored as usable here (see ``now``)
        as_of = epochs if now is None else np.where(epochs > now, now - 1, epochs).astype(np.int16)
        stored = 0
        while hashes.size:
            slot = self._slots(hashes)
            present = self._keys[slot] == hashes
            if present.any():
                at = slot[present]
                e_in, e_old = epochs[present], self._epoch[at]
                fb_in, fb_old = sources[present] == FEEDBACK, self._source[at] == FEEDBACK
                l_in, l_old = losses[present], self._loss[at]
                s_in, s_old = sources[present], self._source[at]
                bits = l_in.view(np.uint32) > l_old.view(np.uint32)  # 0.0 and -0.0 compare equal
                tie = (l_in == l_old) & ((s_in > s_old) | ((s_in == s_old) & bits))
                better = (fb_in & ~fb_old) | ((fb_in == fb_old) & ((l_in > l_old) | tie))
                if sent is not None:
                    # held since before the last exchange: what came was stored after it
                    better |= ~np.isin(self._keys[at], sent)
                newer = (e_in > e_old) | ((e_in == e_old) & better)
                pick = np.flatnonzero(present)[newer]
                self._set(slot[pick], hashes[pick], losses[pick], as_of[pick], sources[pick], mine=False)
                stored += pick.size
            absent = ~present
            hashes, losses, epochs, as_of, sources, slot = (
                hashes[absent], losses[absent], epochs[absent], as_of[absent], sources[absent], slot[absent]
            )  # fmt: skip
            room = self.capacity - self._count
            if hashes.size > room:
                # more new keys than room: those first in hash order are taken (every rank
                # merging the same entries keeps the same ones), the rest refused
                self._refused += hashes.size - room
                hashes, losses, epochs, as_of, sources, slot = (
                    hashes[:room], losses[:room], epochs[:room], as_of[:room], sources[:room], slot[:room]
                )  # fmt: skip
            if not hashes.size:
                break
            first = self._claim(slot)
            self._set(slot[first], hashes[first], losses[first], as_of[first], sources[first], mine=False)
            self._count += first.size
            stored += first.size
            rest = np.ones(hashes.size, dtype=bool)
            rest[first] = False
            hashes, losses, epochs, as_of, sources = (
                hashes[rest], losses[rest], epochs[rest], as_of[rest], sources[rest]
            )  # fmt: skip
        self._applied += stored  # the spread is measured again as often as without merges
        return stored

    @_locked
    def lookup(self, hashes: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(loss, source) per hash: NaN loss where unknown or older than ``max_age`` epochs."""
        self.flush()
        hashes = np.asarray(hashes, np.uint64)
        slot = self._slots(hashes)
        return self._read(slot, self._keys[slot] != hashes, epoch)

    def _read(
        self, slot: np.ndarray, unknown: np.ndarray | None, epoch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(loss, source) at ``slot``: NaN loss where ``unknown`` (a mask, or None: all known) or
        older than ``max_age`` epochs."""
        usable = self._usable(self._epoch[slot], epoch)
        if unknown is not None:
            usable &= ~unknown
        loss = np.where(usable, self._loss[slot].astype(np.float64), np.nan)
        return loss, self._source[slot]

    @_locked
    def lookup_keys(self, keys: Keys, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``lookup(key_hashes(keys), epoch)``, with no hashing or probing for cached keys."""
        self.flush()
        slots = self._cached_slots(keys)
        if slots is None:
            return self.lookup(key_hashes(keys), epoch)
        miss = np.flatnonzero(slots < 0)
        if not miss.size:
            return self._read(slots, None, epoch)
        hashes = key_hashes(pick_keys(keys, miss))
        found = self._slots(hashes)
        held = self._keys[found] == hashes
        # a key not held reads the empty slot it would go to, marked unknown
        slots[miss] = found
        self._remember_slots(keys, miss[held], hashes[held])
        unknown = np.zeros(slots.size, dtype=bool)
        unknown[miss[~held]] = True
        return self._read(slots, unknown, epoch)

    @_locked
    def update_keys(self, keys: Keys, losses: np.ndarray, epoch: int, source: int) -> None:
        """``update(key_hashes(keys), losses, epoch, source)``, with no hashing or probing when
        every key is cached, distinct and has a finite loss (the training step's usual batch)."""
        self.flush()
        losses = np.asarray(losses)
        _check_pairs(keys, losses.size)
        slots = self._cached_slots(keys)
        if slots is None:
            self.update(key_hashes(keys), losses, epoch, source)
            return
        losses = np.asarray(losses, dtype=np.float32)
        n = slots.size
        # a float64 sum of float32 losses is finite exactly when every loss is
        total = float(losses.sum(dtype=np.float64))
        if (
            n
            and slots.min() >= 0
            and np.isfinite(total)
            and (_distinct(slots) if isinstance(keys, np.ndarray) else len(set(keys)) == n)
        ):
            # every key is held (cached slots are never empty): no probing, no new slot
            check_epoch(epoch)
            old = self._loss[slots]
            if source == FEEDBACK:
                self._drift_to(epoch)
                self._note_drift(slots, losses, epoch, old)
            else:
                self._repeated += self._rescored(slots, epoch, source)
            self._sum.change(losses, old)
            self._below_zero += _below(losses) - _below(old)
            self._applied += n
            self._loss[slots] = losses
            self._epoch[slots] = epoch
            self._source[slots] = source
            self._mark[slots] = _UNSENT
            return
        hashes = self._hashes_at(keys, slots)
        self.update(hashes, losses, epoch, source)
        miss = np.flatnonzero(slots < 0)
        self._remember_slots(keys, miss, hashes[miss])

    # ------------------------------------------------------------------ state and files

    def _occupied(self) -> np.ndarray:
        return np.flatnonzero(self._keys != _EMPTY)

    @_locked
    def state_dict(self) -> dict[str, Any]:
        self.flush()
        at = self._occupied()
        return {
            "capacity": self.capacity,
            "max_age": self.max_age,
            "keys": torch.from_numpy(self._keys[at].view(np.int64).copy()),
            "loss": torch.from_numpy(self._loss[at].copy()),
            "epoch": torch.from_numpy(self._epoch[at].copy()),
            "source": torch.from_numpy(self._source[at].copy()),
            "unsynced": torch.from_numpy(self._unsent()[at]),
            "merged": torch.from_numpy(self._mark[at] == _MERGED),
            "refused": self._refused,
            "repeated": self._repeated,
            "drift": torch.from_numpy(self._drift.copy()),
            "drift_epoch": self._drift_epoch,
            "drift_verdict": None if np.isnan(self._verdict) else self._verdict,
            "drift_mean": [None if np.isnan(m) else float(m) for m in self._drift_mean],
            "hard": torch.from_numpy(self._hard.copy()),
            "hard_verdict": None if np.isnan(self._hard_verdict) else self._hard_verdict,
            "applied": self._applied,
            "spread": None if np.isnan(self._spread) else self._spread,
            "spread_at": self._spread_at,
        }

    @_locked
    def load_state_dict(self, state: Mapping[str, Any], *, fit: bool = False) -> None:
        """Restore ``state_dict()``. ``fit``: load what fits into a smaller memory (the rest is
        refused and counted) instead of raising ``ResumeError``. A damaged state (a missing or
        malformed entry, tensors of different lengths, an empty-slot or repeated key) raises
        ``ResumeError`` naming it, and the memory is left as it was."""
        self.flush()

        def bad(entry: str, want: str) -> ResumeError:
            entry = entry.replace("memory", "state", 1)
            return ResumeError(
                f"the score memory's {entry} must be {want}; the state is damaged, or not one "
                "ScoreMemory.state_dict() wrote"
            )

        check_memory_state(state, bad)
        if not fit and int(state["capacity"]) > self.capacity:
            raise ResumeError(
                f"the checkpoint's score memory holds up to {state['capacity']} samples; this one "
                f"{self.capacity}: construct ScoreMemory(capacity={state['capacity']}) to resume"
            )
        if not fit and state["max_age"] != self.max_age:
            raise ResumeError(
                f"the checkpoint's score memory uses its losses for max_age={state['max_age']!r} "
                f"epochs; this one for {self.max_age!r}: construct ScoreMemory(max_age="
                f"{state['max_age']!r}) to resume"
            )
        keys = state["keys"].numpy().view(np.uint64)
        if not _distinct_keys(keys):
            raise bad("memory['keys']", f"distinct non-zero key hashes, got {short_repr(keys[:8].tolist())}")
        marks = {
            name: None if state.get(name) is None else state[name].numpy() for name in ("unsynced", "merged")
        }
        self._fill(keys, state["loss"].numpy(), state["epoch"].numpy(), state["source"].numpy())
        if keys.size:
            slot = self._slots(keys)
            held = self._keys[slot] == keys  # (a smaller memory loaded with fit= refused some)
            # a state written before sync_memory: no entry of it was ever handed to another rank
            unsent = marks["unsynced"] if marks["unsynced"] is not None else np.ones(keys.size, bool)
            self._mark[slot[held & unsent]] = _UNSENT
            if marks["merged"] is not None:
                self._mark[slot[held & marks["merged"]]] = _MERGED
        self._refused += int(state["refused"])
        self._repeated = int(state.get("repeated", 0))  # states written before the count lack it
        if "drift" in state:  # states written before the forgetting measure lack it
            self._drift = state["drift"].numpy().astype(np.float64).reshape(2, 2, 2).copy()
            self._drift_epoch = int(state["drift_epoch"])
            verdict = state.get("drift_verdict")
            self._verdict = float("nan") if verdict is None else float(verdict)
        if "hard" in state:  # states written before the persistent-hard measure lack it
            self._hard = state["hard"].numpy().astype(np.float64).reshape(2, 2).copy()
            verdict = state.get("hard_verdict")
            self._hard_verdict = float("nan") if verdict is None else float(verdict)
        means = state.get("drift_mean")
        if means is not None:
            self._drift_mean = np.array([np.nan if m is None else float(m) for m in means])
        else:  # states written before it: the mean loaded (what the epoch's updates would meet)
            self._drift_mean = np.array([self._mean(), np.nan])
        # states written before the spread measure lack it: measured at the next read
        self._applied = int(state.get("applied", 0))
        spread = state.get("spread")
        self._spread = float("nan") if spread is None else float(spread)
        at = state.get("spread_at")
        self._spread_at = None if at is None else int(at)
        self._read_spread = None

    def _fill(self, keys: np.ndarray, loss: np.ndarray, epoch: np.ndarray, source: np.ndarray) -> None:
        self._keys[:] = _EMPTY
        self._slot_of.clear()  # the keys take new slots
        if self._slot_of_int is not None:
            self._slot_of_int.fill(-1)
        self._count = 0
        self._sum.clear()
        self._below_zero = 0
        self._refused = 0
        self._repeated = 0
        self._spread, self._spread_at, self._read_spread = float("nan"), None, None
        # the newest epoch first, training losses before forwards: what a smaller memory refuses
        # (load_state_dict(fit=True)) is the oldest, not the freshest
        for e in np.unique(epoch)[::-1]:
            for s in sorted(np.unique(source[epoch == e]).tolist(), key=lambda s: s != FEEDBACK):
                pick = (epoch == e) & (source == s)
                self.update(keys[pick], loss[pick], int(e), int(s))
        self._mark[:] = _SENT  # filled, not stored here (load_state_dict says which were)
        # after the fill, whose updates moved them: the filled losses are no evidence of
        # forgetting, and the next epoch's mean is the whole table's, not a part's
        self._drift = np.zeros((2, 2, 2))
        self._drift_epoch = 0
        self._drift_mean = np.full(2, np.nan)
        self._verdict = float("nan")  # the last forgetting measured over a whole epoch
        self._hard = np.zeros((2, 2))
        self._hard_verdict = float("nan")

    def save(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        """Write the memory to ``url`` (any fsspec URL) as an ``.npz`` of plain arrays (no pickle).

        A failure of the storage (no space, no permission) raises ``SiftError`` naming the file
        and the cause."""
        # (s3fs reads s3://KEY:SECRET@bucket as a bucket named so, quoted back in its errors:
        # refused as publish() refuses it; the review of 2026-12-06)
        refuse_credentials_in_url(url, ConfigError)
        try:
            self._save(url, storage_options)
        except OSError as exc:
            shown = redact(redact_url(url), secret_values(storage_options))
            raise storage_error(f"saving the score memory to {shown}", exc) from None

    def _save(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        # the snapshot under the lock, the write without it: another thread's updates wait for
        # the copy, not for the storage (publish read the table unlocked, save held the lock
        # through the upload)
        _put_whole(url, self._npz(), storage_options)

    @_locked
    def _npz(self) -> bytes:
        """The memory as ``save`` writes it: an ``.npz`` of plain arrays."""
        self.flush()
        at = self._occupied()
        buffer = io.BytesIO()
        np.savez(
            buffer,
            keys=self._keys[at],
            loss=self._loss[at],
            epoch=self._epoch[at],
            source=self._source[at],
            # max_age 0 stands for None (never expires)
            config=np.array([self.capacity, self.max_age or 0, self.refused], dtype=np.int64),
        )
        return buffer.getvalue()

    def publish(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        epoch: int,
        seed: int | None,
        beta: float,
        audit_directory: str | None = None,
        rank: int | None = None,
        keep: int | None = 2,
        run_began: float | None = None,
        key: Mapping[str, Any] | None = None,
        retry_timeout: float = RETRY_TIMEOUT,
    ) -> str:
        """Publish this memory for ``PreDecodeFilter`` stages (``siftpipe.predecode``) under ``url``:
        ``memory-<version>.npz`` and then ``latest.json`` naming it, with the ``epoch``, ``seed``
        and ``beta`` workers decide with, the audit log ``audit_directory`` their records go
        next to and the ``rank`` that published (a filter of another rank refuses it). Returns
        the version (``<epoch>-<random>``).

        ``keep``: publications (files) of this memory to keep under ``url``, the new one
        included; older ones this memory published there are deleted once ``latest.json`` names
        the new one (one publication is about 15 bytes a remembered sample: one an epoch of a
        large dataset adds up). The default 2 keeps the one before, which a worker that read
        the old ``latest.json`` a moment ago may still be loading. ``None``: delete nothing.
        Files another process (an earlier run, a job before a restart) published are never
        deleted here. A file that cannot be deleted is a ``PreDecodeWarning``, not an error.
        ``run_began``: when the publishing run began (``Sifter``'s, kept across resumes): a
        filter told another run's refuses the publication. ``key``: how the stage keys samples
        (``{"field": name}``, ``{"function": "shard_key"}`` or ``{"function": None}`` for one a
        filter cannot know), so that a filter finds samples by the same keys.
        ``retry_timeout``: seconds each file is written again while storage fails in a way that
        may pass (a refused connection, a timeout, a 5xx or 429 answer), as the audit log's writes
        are; past them a
        ``SiftError`` names the publication (before 2026-12-05 an outage of 8 s was botocore's
        raw error; found by review)."""

        # refused, as the filters reading it refuse it: s3fs would take s3://KEY:SECRET@bucket
        # for a bucket named KEY:SECRET and name it in its errors
        refuse_credentials_in_url(url, ConfigError)
        if keep is not None and (not is_int(keep) or keep < 1):
            raise ConfigError(f"keep must be a number of publications >= 1 or None, got {keep!r}")
        retry_timeout = check_retry_timeout(retry_timeout)
        version = f"{epoch:06d}-{_random.token_hex(4)}"
        url = url.rstrip("/")
        shown = redact(redact_url(url), secret_values(storage_options))
        try:
            retrying(
                lambda: self._save(f"{url}/memory-{version}.npz", storage_options),
                f"publishing the score memory to {shown}",
                retry_timeout,
            )
        except OSError as exc:
            raise storage_error(f"publishing the score memory to {shown}", exc) from None
        meta = {
            "version": version,
            "file": f"memory-{version}.npz",
            "epoch": epoch,
            "seed": seed,
            "beta": float(beta),
            "audit": None if audit_directory is None else {"directory": audit_directory},
            "rank": rank,
            "published": time.time(),
            "run_began": run_began,
            "key": None if key is None else dict(key),
        }
        # a checksum over the rest: a flipped digit still reads as JSON and changed the seed or
        # beta every worker decides with, unsaid (found 2026-12-05)
        meta["sha256"] = publication_checksum(meta)
        # whole or not at all: workers read it at any moment (rewritten in place, a reader
        # caught it empty: JSONDecodeError in a DataLoader worker)
        body = json.dumps(meta).encode()
        files = self._published.setdefault(url, [])
        try:
            retrying(
                lambda: _put_whole(f"{url}/latest.json", body, storage_options),
                f"publishing the score memory's latest.json to {shown}",
                retry_timeout,
            )
        except BaseException as exc:
            # the file no latest.json names: deleted, or (when that cannot be told or done)
            # pruned with the next publications by keep= (found by review, 2026-12-06: it stayed
            # for good). Only once latest.json is read back naming another: a write the store
            # took whose answer was lost (or an interrupt after it) names this one, and deleting
            # it stopped every worker (the review of that fix)
            gone = (
                isinstance(exc, Exception)
                and _latest_names_another(url, version, storage_options)
                and _delete_quietly(f"{url}/memory-{version}.npz", storage_options)
            )
            if not gone:
                files.append(f"memory-{version}.npz")
            if isinstance(exc, OSError):
                raise storage_error(f"publishing the score memory's latest.json to {shown}", exc) from None
            raise
        files.append(f"memory-{version}.npz")
        if keep is not None and len(files) > keep:
            _delete_files(url, files[:-keep], storage_options)
            del files[:-keep]
        return version

    @classmethod
    def load(
        cls, url: str, storage_options: Mapping[str, Any] | None = None, *, lookups_only: bool = False
    ) -> ScoreMemory:
        """A memory read from ``save``'s file.

        Args:
            url: The file (any fsspec URL).
            storage_options: fsspec options for ``url``.
            lookups_only: Size the table to the losses the file holds, not to the capacity it was
                saved with (a memory of capacity 50M holding 1,000 losses took about 1 GiB in each
                ``PreDecodeFilter`` worker): for reading; updates beyond those keys are refused.
        """
        import fsspec

        refuse_credentials_in_url(url, ConfigError)  # (as save refuses it)
        with fsspec.open(url, "rb", **(storage_options or {})) as f:
            raw = f.read()
        try:
            data = np.load(io.BytesIO(raw), allow_pickle=False)
            arrays = {name: data[name] for name in ("config", "keys", "loss", "epoch", "source")}
            capacity, max_age, refused = (int(v) for v in arrays["config"])
        except (
            KeyError,
            IndexError,
            ValueError,
            OSError,
            TypeError,
            EOFError,
            zipfile.BadZipFile,
            # a flipped flag in the zip's directory: "is encrypted", "compression method is not
            # supported" (found by review, 2026-12-05: raw in every worker)
            RuntimeError,
            NotImplementedError,
        ) as exc:
            # (the URL is not repeated: it may carry credentials, and the caller knows it)
            raise ConfigError(
                f"the file is not a score memory file ScoreMemory.save wrote ({type(exc).__name__}: "
                f"{exc}); pass the URL of a memory-*.npz that save or publish wrote"
            ) from None
        keys, loss, epoch, source = (arrays[n] for n in ("keys", "loss", "epoch", "source"))
        kinds = {"keys": np.uint64, "loss": np.float32, "epoch": np.int16, "source": np.int8}
        wrong = [n for n, kind in kinds.items() if arrays[n].dtype != kind or arrays[n].ndim != 1]
        if wrong or len({keys.size, loss.size, epoch.size, source.size}) != 1:
            problem = (
                f"its {wrong[0]!r} array is not 1-d {kinds[wrong[0]].__name__}"
                if wrong
                else ("its arrays differ in length")
            )
        elif not (capacity >= 1 and max_age >= 0 and refused >= 0 and keys.size <= capacity):
            problem = f"its capacity, max_age and refused count ({capacity}, {max_age}, {refused}) do not fit"
        elif not np.isfinite(loss).all():
            problem = "it holds a loss that is not finite"
        elif not _distinct_keys(keys):
            problem = "it holds an empty-slot or repeated key"
        else:
            problem = ""
        if problem:
            raise ConfigError(
                f"the score memory file is damaged: {problem}; pass the URL of a memory-*.npz that "
                "save or publish wrote"
            )
        if lookups_only:
            capacity = max(1, int(keys.size))
        memory = cls(capacity, max_age or None)
        memory._fill(arrays["keys"], arrays["loss"], arrays["epoch"], arrays["source"])
        memory._refused = refused
        return memory

    @_locked
    def losses(self) -> np.ndarray:
        """Every remembered loss (any age), for summaries."""
        self.flush()
        return self._loss[self._occupied()].astype(np.float64)


def _latest_names_another(url: str, version: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``url``'s latest.json reads, and names a publication other than ``version``
    (none: no publication names ``version``)."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(f"{url}/latest.json", **(storage_options or {}))
        # (read, not exists(): s3fs may answer that from a listing cached before the write)
        return bool(json.loads(fs.cat_file(path)).get("version") != version)
    except FileNotFoundError:
        return True
    except Exception:  # (unreadable: cannot tell, so keep the file for keep= to prune)
        return False


def _delete_quietly(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Delete ``url``; whether it is gone."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
        fs.rm_file(path)
    except FileNotFoundError:
        return True
    except Exception:  # (best effort: the caller keeps it to prune later)
        return False
    return True


def _put_whole(url: str, data: bytes, storage_options: Mapping[str, Any] | None) -> None:
    """``put_whole`` at ``url`` (a reader sees the old file or the new one, never a part)."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **(storage_options or {}))
    put_whole(fs, path, data)


def _delete_files(url: str, names: list[str], storage_options: Mapping[str, Any] | None) -> None:
    """Delete the files ``names`` under ``url``; a ``PreDecodeWarning`` for any that cannot be."""
    import warnings

    from fsspec.core import url_to_fs

    from ..errors import PreDecodeWarning

    fs, root = url_to_fs(url, **(storage_options or {}))
    for name in names:
        try:
            fs.rm_file(f"{root.rstrip('/')}/{name}")
        except FileNotFoundError:
            continue  # deleted already (by hand, by a lifecycle rule): what was wanted
        except OSError as exc:
            warnings.warn(
                f"siftpipe: an old score-memory publication {name} could not be deleted "
                f"({type(exc).__name__}); it stays, taking space: delete it by hand, or pass "
                "keep=None to publish_memory to keep every publication",
                PreDecodeWarning,
                stacklevel=4,
            )


def _joined(run: list[tuple[Keys, np.ndarray, int, int]]) -> tuple[Keys, np.ndarray]:
    """The keys and losses of deferred hand-overs, one after the other (integer arrays stay one
    array; anything else is one list)."""
    if len(run) == 1:
        return run[0][0], run[0][1]
    losses = np.concatenate([r[1] for r in run])
    if all(isinstance(r[0], np.ndarray) for r in run):
        joined = np.concatenate([r[0] for r in run])  # type: ignore[misc]
        if joined.dtype.kind in "iu":  # (int64 with uint64 makes float64: 1 would be the key "1.0")
            return joined, losses
    keys = [k for r in run for k in (r[0].tolist() if isinstance(r[0], np.ndarray) else r[0])]
    return keys, losses


def _distinct(values: np.ndarray) -> bool:
    """No value of ``values`` is repeated (a sort and a compare: cheaper than ``np.unique``)."""
    ordered = np.sort(values)
    return not np.count_nonzero(ordered[1:] == ordered[:-1])


def pick_keys(keys: Keys, index: np.ndarray) -> Keys:
    """``keys[index]`` for a list or an array of keys."""
    if isinstance(keys, np.ndarray):
        return keys[index]
    return [keys[i] for i in index.tolist()]


def hashes_of(keys: Sequence[Any] | np.ndarray) -> np.ndarray:
    """``key_hashes`` unless the keys are already hashes (uint64)."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64:
        return keys
    return key_hashes(keys)
