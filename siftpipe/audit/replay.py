"""Offline use of an audit log: replay a run's data without the model, and what-if re-sifting."""

from __future__ import annotations

import json
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .._secrets import redact, secret_values
from ..core.decide import (
    PREDECODE,
    REASONS,
    UNKNOWN,
    WARMUP,
    decide_rows,
)
from ..core.policies import Policy
from ..core.rows import weighted_sample
from ..core.values import scalar_key
from ..core.vocab import loggable_text
from ..errors import AuditError, ConfigError, MissingKeyError
from .reader import (
    PartInfo,
    list_parts,
    not_handed_on,
    read_checked,
    read_log,
    unhanded_ranges,
)

__all__ = ["Replay", "WhatIf", "replay", "whatif"]

OnMissing = Literal["raise", "keep", "drop"]
_DECISION_COLUMNS = ["seq", "epoch", "key", "url", "kept", "weight"]


class _ShardDecisions:
    """The logged decisions for one shard: (key, epoch) -> the row of its kept flag and weight
    (rows in seq order; a key that comes more than once in a shard's epoch: a list of rows).
    Rows are indexes into two arrays, not a tuple each: about 250 bytes a decision with keys of
    30 characters, where tuples in lists took about 500 (measured by review, 2026-12-05)."""

    __slots__ = ("by_key", "kept", "nbytes", "used", "weight")

    def __init__(self, keys: list[str], epochs: np.ndarray, kept: np.ndarray, weight: np.ndarray) -> None:
        by_key: dict[tuple[str, int], Any] = {}
        for row, slot in enumerate(zip(keys, epochs.tolist())):
            at = by_key.setdefault(slot, row)
            if at != row:  # the key again in this shard's epoch: its rows, in order
                if type(at) is int:
                    by_key[slot] = [at, row]
                else:
                    at.append(row)
        self.by_key = by_key
        self.kept = np.asarray(kept, dtype=bool)
        self.weight = np.asarray(weight, dtype=np.float64)
        #: rows handed on this epoch: a key's next occurrence is its first row not used yet
        self.used = np.zeros(len(keys), dtype=bool)
        self.nbytes = sum(len(k) for k in keys) + _BYTES_PER_DECISION * len(keys)

    def take(self, slot: tuple[str, int]) -> tuple[bool, float] | None:
        """The kept flag and weight of ``slot``'s next occurrence this epoch (None: the log has
        no more of them), marked used."""
        at = self.by_key.get(slot)
        if at is None:
            return None
        used = self.used
        if type(at) is int:
            if used[at]:
                return None
            row = at
        else:
            row = next((r for r in at if not used[r]), -1)
            if row < 0:
                return None
        used[row] = True
        return bool(self.kept[row]), float(self.weight[row])


#: What a held decision costs besides its key's characters, in bytes (its dict entry, the
#: (key, epoch) tuple, the string's header, its row; measured with tracemalloc on CPython 3.11:
#: 275 bytes a decision with keys of 30 characters, occurrences counted)
_BYTES_PER_DECISION = 245


def _again(shard: _ShardDecisions, slot: tuple[str, int]) -> str:
    """ ", its N-th time" when the log has the sample but fewer times than it came (for messages)."""
    at = shard.by_key.get(slot)
    logged = 0 if at is None else 1 if type(at) is int else len(at)
    return f", its time {logged + 1}: the log has it {logged} time(s)" if logged else ""


def _key_text(key: Any) -> str:
    """A sample key as the audit log writes it: ``str`` of it (a Python or numpy integer, a
    map-style dataset's index, as its digits; a batch's key column gives Python values; a 0-d
    tensor is its value, as the stage reads it)."""
    return loggable_text(key if type(key) is str else str(scalar_key(key)))


class _Unlogged(float):
    """The weight of a sample the log lacks, kept (``on_missing="keep"``): 1 in a batch's column,
    none on a single sample (told apart by identity)."""


_UNLOGGED = _Unlogged(1.0)


def _is_column(value: Any, batched: bool | None) -> bool:
    """A batch's key column rather than one sample's key: as the logged run read its items
    (``batched``, from its manifests: a batched run's items are batches, whose key column may be
    (B,) or (B, 1); a per-sample run's are samples, whose key may be a tensor of one element);
    when the log does not say, a list, tuple, 1-d tensor or array."""
    if batched is not None:
        return batched and (isinstance(value, list | tuple) or getattr(value, "ndim", 0) >= 1)
    if isinstance(value, list | tuple):
        return True
    return getattr(value, "ndim", 0) == 1


class Replay:
    """A stage that yields exactly the samples a logged run kept, matched by sample key.

    Feed it the same data stream the logged run saw (same shards, same order within each shard):
    each sample is matched to the logged decision for its (shard URL, key, epoch, occurrence),
    where the occurrence counts repeats of the key within the epoch (resampled shards), and is
    handed on if that run kept it, with its logged weight attached if the run attached weights.
    No model is needed.

    Decisions are loaded per shard, lazily, from the parts whose manifests list that shard, and
    at most ``cache_shards`` shards are held (least recently used go first), so memory stays
    bounded for logs of any size: about 245 bytes per held decision plus the key's length.

    Args:
        url: Root of the audit log.
        storage_options: fsspec options for ``url``.
        run: The run to replay (required when the log holds several).
        rank: Only this rank's decisions (default: all ranks; shards are matched by URL).
        key: How the logged run keyed its samples: a dict field (or a tuple position) holding
            the key, or the function it was given (``sp.shard_key``).
        on_missing: A sample with no logged decision: ``"raise"`` (``AuditError``), or
            ``"keep"``/``"drop"`` it (counted in ``stats["missing"]``).
        attach_weight: Attach logged weights as ``weight_field``; default: if the logged stage did.
        weight_field: Dict field for the weight.
        cache_shards: Shards whose decisions are held at once.
    """

    def __repr__(self) -> str:
        return (
            f"Replay({redact(self.url, self._secrets)!r}, run={self.run!r}, on_missing={self.on_missing!r}, "
            f"parts={len(self._parts)}, held_shards={len(self._shards)})"
        )

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        run: str | None = None,
        rank: int | Sequence[int] | None = None,
        key: str | int | Callable[[Any], Any] = "__key__",
        on_missing: OnMissing = "raise",
        attach_weight: bool | None = None,
        weight_field: str = "__sift_weight__",
        cache_shards: int = 64,
    ) -> None:
        if on_missing not in ("raise", "keep", "drop"):
            raise ConfigError(f"on_missing must be 'raise', 'keep' or 'drop', got {on_missing!r}")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.key = key
        self.on_missing = on_missing
        self.weight_field = weight_field
        self.cache_shards = cache_shards
        self._fs, infos, attempts = list_parts(url, storage_options, run=run, rank=rank, strict=True)
        # rows recorded as kept that a pass left before handing on: not kept (never trained)
        self._unhanded = unhanded_ranges(attempts)
        self._secrets = secret_values(storage_options, url)
        shown = redact(url, self._secrets)
        runs = sorted({p.run for p in infos})
        if not runs:
            raise AuditError(
                f"no audit parts found under {shown} (run={run!r}, rank={rank!r}); check the URL"
            )
        if len(runs) > 1:
            raise ConfigError(f"the log at {shown} holds runs {runs}; pass run=<one of them> to replay one")
        self.run = runs[0]
        self._parts = [p for p in infos if p.path is not None]
        self._by_url: dict[Any, list[PartInfo]] = {}
        self._unindexed: list[PartInfo] = []
        for info in self._parts:
            urls = (info.manifest or {}).get("urls")
            if urls is None:
                self._unindexed.append(info)  # no manifest: may hold any shard
                continue
            for u in urls:
                self._by_url.setdefault(u, []).append(info)
            # rows without a URL: a part that says it holds some, or lists no URL at all; a
            # manifest from before it said (2026-12-04) cannot rule them out
            no_url = (info.manifest or {}).get("no_url")
            if not urls or no_url is not False:
                self._by_url.setdefault(None, []).append(info)
        modes = {
            bool(stage["batched"])
            for stage in (((p.manifest or {}).get("stage") or {}) for p in infos)
            if isinstance(stage, Mapping) and "batched" in stage
        }
        self._batched: bool | None = modes.pop() if len(modes) == 1 else None
        if attach_weight is None:
            attach_weight = any(bool(((p.manifest or {}).get("stage") or {}).get("weighted")) for p in infos)
        self.attach_weight = attach_weight
        self._shards: OrderedDict[Any, _ShardDecisions] = OrderedDict()
        self._urls: dict[Any, str] = {}
        self._part_cache: OrderedDict[str, Any] = OrderedDict()
        # the rows an evicted shard had handed on this epoch (its `used`, a byte a decision):
        # a shard read again after it was evicted (resampled shards) is matched from the
        # occurrence it is at, not from its first again. (A dict of every (key, epoch) handed
        # on, before 2026-12-05: about 200 bytes a sample, growing with the epoch however few
        # shards were held.)
        self._used: dict[Any, np.ndarray] = {}
        self.epoch = 0
        self._passes = 0
        self._read = False  # the last pass was read (its first next() came)
        self._epoch_set = False
        self.stats = {"seen": 0, "kept": 0, "dropped": 0, "missing": 0}

    def set_epoch(self, epoch: int) -> None:
        """Match decisions of logged epoch ``epoch`` from now on (the next pass does not add one)."""
        self.epoch = int(epoch)
        self._epoch_set = True
        self._new_epoch()

    def _new_epoch(self) -> None:
        """Nothing handed on yet in this epoch."""
        self._used.clear()
        for shard in self._shards.values():
            shard.used[:] = False

    @property
    def held_bytes(self) -> int:
        """Approximate memory held by cached decisions, in bytes."""
        return sum(s.nbytes for s in self._shards.values())

    def __call__(self, source: Iterable[Any]) -> Iterator[Any]:
        """Replay over ``source``; a new call is a new pass (epoch + 1 unless ``set_epoch``, or
        unless the last pass was never read: the ``Sifter`` does not count such a pass either)."""
        if self._passes == 0 and not self._epoch_set and _in_worker():
            # a DataLoader worker's copy, never told the epoch: each epoch's workers copy the
            # replay afresh, so every epoch would be matched against epoch 0's decisions, with no
            # sample missing to say so (found by review, 2026-12-05)
            raise ConfigError(
                "siftpipe.Replay is running in a DataLoader worker's copy of it, never told its "
                "epoch: it cannot count the epochs before it (the workers of a loader without "
                "persistent_workers copy it afresh each epoch, and would all replay epoch 0's "
                "decisions). Call set_epoch(epoch) on the replay in the training process before "
                "each epoch's loop, epoch 0 included (a .replay() chain: "
                "chain.replayer.set_epoch(epoch)); persistent workers then count on from there. "
                "Its stats count in the workers' copies"
            )
        if self._passes > 0 and not self._epoch_set and self._read:
            self.epoch += 1
            self._new_epoch()
        self._epoch_set = False
        self._read = False
        self._passes += 1
        return self._run(source)

    def _run(self, source: Iterable[Any]) -> Iterator[Any]:
        self._read = True  # (at the first next(): a pass opened and dropped unread is not an epoch)
        key = self.key
        for item in source:
            try:
                # a function too, as the run's (key=sp.shard_key; found by review, 2026-12-05:
                # a run keyed by it could not be replayed)
                k = key(item) if callable(key) else item[key]
            except (KeyError, TypeError, IndexError):
                what = f"no field {key!r}" if not callable(key) else f"what {key!r} reads"
                raise MissingKeyError(
                    f"replay needs a key in every sample, but a sample has {what}; pass key= as the "
                    "run keyed its samples (a field, or the function: key=sp.shard_key) and keep "
                    "what it reads in the pipeline up to the replay stage"
                ) from None
            if _is_column(k, self._batched):
                # a collated batch (a run with batched=True): its kept rows, in one batch
                kept_rows = self._batch(item, k)
                if kept_rows is not None:
                    yield kept_rows
                continue
            url = item.get("__url__") if isinstance(item, Mapping) else None
            decision = self._decision(_key_text(k), url)
            if decision is None:
                continue
            if self.attach_weight and not (decision is _UNLOGGED and isinstance(item, Mapping)):
                # as the run put it: a dict's field, a namedtuple's field, a tuple's last element
                # (one the log lacks weighs 1 there: the tuples keep the run's shape; found by
                # review, 2026-12-05, a tuple replayed without the weight the run gave it)
                item = weighted_sample(item, self.weight_field, float(decision))
            yield item

    def _decision(self, k: str, url: Any) -> float | None:
        """The logged weight of the next occurrence of key ``k`` of shard ``url`` this epoch, or
        ``None`` if the run dropped it (``on_missing`` decides for a sample the log lacks: kept,
        it is ``_UNLOGGED``, a weight of 1 that a single sample is not given)."""
        stats = self.stats
        if url is not None:
            url = self._recorded_url(url)
        shard = self._shard(url)
        slot = (k, self.epoch)
        logged = shard.take(slot)
        stats["seen"] += 1
        if logged is None:
            stats["missing"] += 1
            if self.on_missing == "raise":
                raise AuditError(
                    f"sample {k!r} (shard {url!r}, epoch {self.epoch}{_again(shard, slot)}) has no "
                    f"decision in run {self.run!r} of the log at {redact(self.url, self._secrets)}: the "
                    "stream differs from the logged run's, the run keyed its samples otherwise (give "
                    "replay the run's key=, e.g. key=sp.shard_key), or the log lost it (siftpipe log "
                    "verify); pass on_missing='keep' or 'drop' to go on"
                )
            if self.on_missing == "drop":
                stats["dropped"] += 1
                return None
            stats["kept"] += 1
            return _UNLOGGED
        kept, weight = logged
        if not kept:
            stats["dropped"] += 1
            return None
        stats["kept"] += 1
        return float(weight)

    def _batch(self, batch: Any, keys: Any) -> Any:
        """The rows of a collated batch the logged run kept (``None`` if none), with the logged
        weights as a float32 tensor column if weights are attached (as the run attached them)."""
        import torch

        from ..core import batch as _batch
        from ..core.rows import key_list

        texts = [_key_text(k) for k in key_list(keys)]
        urls = batch.get("__url__") if isinstance(batch, Mapping) else None
        if urls is None or isinstance(urls, str):
            urls = [urls] * len(texts)
        elif len(urls) != len(texts):
            raise AuditError(
                f"a batch holds {len(texts)} keys but {len(urls)} __url__ values; replay reads one "
                "of each per row"
            )
        decided = [self._decision(k, u) for k, u in zip(texts, urls)]
        index = np.array([i for i, d in enumerate(decided) if d is not None], dtype=np.int64)
        if not index.size:
            return None
        kept = batch if index.size == len(texts) else _batch.take(batch, index)
        if self.attach_weight:
            weights = torch.tensor([decided[i] for i in index.tolist()], dtype=torch.float32)
            device = _batch.accelerator_of(kept)  # beside the batch's tensors, as the run put it
            if device is not None:
                weights = weights.to(device)
            kept = _batch.with_column(kept, self.weight_field, weights)
        return kept

    def _recorded_url(self, url: Any) -> str:
        """``url`` as the log recorded it: without credentials (a presigned URL, say)."""
        recorded = self._urls.get(url)
        if recorded is None:
            if len(self._urls) > 100_000:
                self._urls.clear()
            recorded = self._urls[url] = loggable_text(redact(str(url), self._secrets))
        return recorded

    def _shard(self, url: Any) -> _ShardDecisions:
        shard = self._shards.get(url)
        if shard is not None:
            self._shards.move_to_end(url)
            return shard
        import pyarrow.compute as pc

        parts = self._by_url.get(url, []) + self._unindexed
        keys: list[str] = []
        epochs, kept, weight, seqs = [], [], [], []
        ranks: list[tuple[int, int]] = []  # (rank, rows) of each part that holds rows of the shard
        for info in parts:
            table = self._part(info)
            column = table.column("url")
            mask = pc.is_null(column) if url is None else pc.equal(column, url)
            mask = pc.fill_null(mask, False)
            if info.cutoff != float("inf"):
                mask = pc.and_(mask, pc.less(table.column("seq"), int(info.cutoff)))
            rows = table.filter(mask)
            if not rows.num_rows:
                continue
            keys.extend(str(k) for k in rows.column("key").to_pylist())
            epochs.append(rows.column("epoch").to_numpy())
            kept.append(rows.column("kept").to_numpy(zero_copy_only=False))
            weight.append(rows.column("weight").to_numpy())
            seqs.append(rows.column("seq").to_numpy())
            ranks.append((info.rank, rows.num_rows))
        if len({r for r, _ in ranks}) > 1:
            self._check_ranks_apart(url, keys, epochs, ranks)
        if seqs:
            order = np.argsort(np.concatenate(seqs), kind="stable")
            keys = [keys[i] for i in order]
            shard = _ShardDecisions(
                keys,
                np.concatenate(epochs)[order],
                np.concatenate(kept)[order],
                np.concatenate(weight)[order],
            )
        else:
            shard = _ShardDecisions([], np.zeros(0, int), np.zeros(0, bool), np.zeros(0))
        used = self._used.pop(url, None)
        if used is not None and used.shape == shard.used.shape:
            shard.used = used  # read again this epoch after it was evicted: where it was
        self._shards[url] = shard
        while len(self._shards) > self.cache_shards:
            gone, evicted = self._shards.popitem(last=False)
            if evicted.used.any():
                self._used[gone] = evicted.used
        return shard

    def _check_ranks_apart(
        self, url: Any, keys: list[str], epochs: list[Any], ranks: list[tuple[int, int]]
    ) -> None:
        """``AuditError`` if two ranks decided one (key, epoch) of shard ``url``: each rank numbers
        its records from 0, so their decisions cannot be put in one order, and a rank's stream
        would be matched with another rank's decisions (found by review, 2026-12-05)."""
        owner: dict[tuple[str, int], int] = {}
        at = 0
        for (rank, n), part_epochs in zip(ranks, epochs):
            for key, epoch in zip(keys[at : at + n], part_epochs.tolist()):
                other = owner.setdefault((key, epoch), rank)
                if other != rank:
                    raise AuditError(
                        f"ranks {sorted({other, rank})} of run {self.run!r} both decided the sample "
                        f"{key!r} of shard {self._recorded_url(url) if url is not None else '(none)'} "
                        f"in epoch {epoch}: their decisions cannot be told apart by key. Replay one "
                        "rank's stream at a time: Replay(url, rank=<the rank that read it>)"
                    )
            at += n

    def _part(self, info: PartInfo) -> Any:
        path = str(info.path)
        table = self._part_cache.get(path)
        if table is None:
            (table,) = read_checked(self._fs, [info], _DECISION_COLUMNS)
            if isinstance(table, Exception):
                raise AuditError(
                    f"cannot read audit part {redact(path, self._secrets)} (truncated, corrupt or not an "
                    f"audit part): {redact(f'{type(table).__name__}: {table}', self._secrets)}; the "
                    "decisions it holds cannot be replayed (siftpipe log verify lists what is damaged)"
                )
            table = not_handed_on(table, self._unhanded.get((info.run, info.rank, info.attempt)))
            self._part_cache[path] = table
            while len(self._part_cache) > 8:
                self._part_cache.popitem(last=False)
        else:
            self._part_cache.move_to_end(path)
        return table


def replay(url: str, storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> Replay:
    """A ``Replay`` stage for the log at ``url`` (see ``Replay`` for the arguments)."""
    return Replay(url, storage_options, **kwargs)


@dataclass
class WhatIf:
    """What one policy would have decided over a log's losses.

    Attributes:
        policy: The policy's repr.
        samples: Decided samples replayed (losses in the log).
        kept: Samples it would keep.
        to_kept: Samples the logged run dropped that it would keep.
        to_dropped: Samples the logged run kept that it would drop.
        logged_kept: Samples the logged run kept.
        keep: Per-sample decisions, in the log's row order.
        after_gap: Samples decided after a gap in their stream's sequence numbers (records lost,
            or dropped by ``on_full="drop"``): the replay cannot redo the missing rows' random
            draws and loss history, so from a gap on it is not the policy re-run.
        flips_after_gap: Of the flips, those among the ``after_gap`` samples.
        no_loss: Samples with no loss in the log (``reason`` ``unknown``: never trained before,
            or decided after the cost guard stopped sifting): every policy keeps them, as the
            logged run did, so they are in ``samples`` and ``kept`` of every policy alike.
        remembered: Samples the logged run decided from a loss a training step handed back in
            an earlier pass (``source`` ``feedback``; and ``stale`` in a run that had such losses,
            whose expiry followed what was trained): another policy would have trained other
            samples and remembered other losses, so its replay there is indicative.
    """

    policy: str
    samples: int
    kept: int
    logged_kept: int
    to_kept: int
    to_dropped: int
    keep: np.ndarray
    after_gap: int = 0
    flips_after_gap: int = 0
    no_loss: int = 0
    remembered: int = 0

    @property
    def keep_rate(self) -> float:
        return self.kept / self.samples if self.samples else float("nan")

    @property
    def flips(self) -> int:
        return self.to_kept + self.to_dropped

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "samples": self.samples,
            "kept": self.kept,
            "keep_rate": round(self.keep_rate, 6),
            "to_kept": self.to_kept,
            "to_dropped": self.to_dropped,
            "flips": self.flips,
            "after_gap": self.after_gap,
            "flips_after_gap": self.flips_after_gap,
            "no_loss": self.no_loss,
            "remembered": self.remembered,
        }


#: The stage settings a manifest records that decide what the stage keeps.
_DECIDING = ("rng_seed", "seed", "delay", "policy", "policy_config", "on_nan", "micro_batch")


def whatif(
    log: Any,
    policies: Sequence[Policy],
    *,
    storage_options: Mapping[str, Any] | None = None,
    seed: int | None = None,
    delay: int | None = None,
    micro_batch: int | None = None,
    run: str | Sequence[str] | None = None,
    rank: int | Sequence[int] | None = None,
    say_losses: bool = True,
) -> list[WhatIf]:
    """Re-run ``policies`` over the logged losses, in order, and compare with the logged decisions.

    Each (run, rank) stream is replayed in sequence order with the logged micro-batch boundaries,
    warm-up and NaN handling, from a fresh copy of each policy and a generator seeded like the
    logged stage's, so re-running the logged policy reproduces the logged decisions exactly.

    Args:
        log: A log URL, or a table from ``read_log`` (then ``seed``/``delay`` default to the
            values found in the log's manifests only if a URL is given; else 0 and inferred).
        policies: Policies to try (copied; yours are not changed).
        storage_options: fsspec options when ``log`` is a URL.
        seed: Generator seed; default: the logged stage's.
        delay: Warm-up in samples; default: the logged stage's.
        micro_batch: Re-chunk into micro-batches of this many samples instead of the logged ones.
        run: With a URL, only these runs.
        rank: With a URL, only these ranks.
        say_losses: Warn when rows have no loss (``WhatIf.no_loss``) or were decided from
            remembered training losses (``WhatIf.remembered``); False for a caller that adds up
            several calls and says it once (``warn_losses``).
    """
    stages: dict[tuple[str, int], dict[str, Any]] = {}
    if isinstance(log, str):
        _, infos, attempts = list_parts(log, storage_options, run=run, rank=rank, strict=True)
        settled: dict[tuple[str, int], set[str]] = {}
        for info in infos:
            if info.manifest and info.manifest.get("stage"):
                stage = info.manifest["stage"]
                stages.setdefault((info.run, info.rank), stage)
                if isinstance(stage, Mapping):
                    what = {k: stage.get(k) for k in _DECIDING}
                    settled.setdefault((info.run, info.rank), set()).add(json.dumps(what, default=str))
        changed = sorted(f"run={r} rank={k}" for (r, k), seen in settled.items() if len(seen) > 1)
        if changed:
            # (found by review, 2026-12-05: a resume's override read as flips, nothing said)
            warnings.warn(
                f"siftpipe: the stage's settings changed between the attempts of {', '.join(changed)} "
                "(a resume that overrode its seed, policy or warm-up: load_state_dict(override=...)); "
                "what-if replays each stream with its first attempt's, so the logged policy re-run "
                "flips decisions made after the change (not a sign of lost records: siftpipe log "
                "verify says that)",
                UserWarning,
                stacklevel=2,
            )
        said = [i.manifest for i in infos] + [a.end for a in attempts]
        if any(isinstance(d, dict) and d.get("merged_history") is True for d in said):
            # found by review, 2026-12-05: a complete log of such a run read as flips
            warnings.warn(
                "siftpipe: this run decided against loss histories merged across ranks "
                "(sp.sync_history, EqualSteps(sync_every=...)), which the log does not hold: the "
                "replay uses each rank's own window, so the logged policy re-run flips some "
                "decisions (not a sign of lost records: siftpipe log verify says that) and other "
                "policies' keep rates are approximate",
                UserWarning,
                stacklevel=2,
            )
        table = read_log(
            log,
            storage_options,
            run=run,
            rank=rank,
            columns=["seq", "loss", "prob", "kept", "reason", "micro_batch", "source"],
            as_decided=True,  # the decisions, also of rows a pass was left before handing on
        )
    else:
        table = log
    if table.num_rows == 0:
        raise AuditError("the log holds no decisions to replay")
    for policy in policies:
        if policy.uses_memory:
            raise ConfigError(
                f"what-if cannot replay {policy!r}: it judges losses against the stage's score memory, "
                "which the log does not hold; try a policy that decides from the logged losses alone"
            )
    reason = np.asarray(table.column("reason").to_pylist(), dtype=object)
    unknown = reason == REASONS[UNKNOWN]
    # kept before decode by a PreDecodeFilter: decided upstream, never by the stage's policy (nor
    # by its generator), as the live stage did
    upstream = reason == REASONS[PREDECODE]
    remembered = _remembered(table, ~upstream)
    if say_losses:
        warn_losses(int(unknown.sum()), remembered, table.num_rows, stacklevel=3)
    upstream_prob = (
        table.column("prob").to_numpy(zero_copy_only=False).astype(np.float64)
        if "prob" in table.column_names
        else np.ones(table.num_rows)
    )
    warm_rows = table.column("seq").to_numpy()[reason == REASONS[WARMUP]]
    inferred_delay = int(warm_rows.max()) + 1 if warm_rows.size else 0
    runs = table.column("run").to_pylist() if "run" in table.column_names else ["?"] * table.num_rows
    ranks = table.column("rank").to_numpy() if "rank" in table.column_names else np.zeros(table.num_rows, int)
    losses = table.column("loss").to_numpy()
    logged = table.column("kept").to_numpy(zero_copy_only=False)
    seqs = table.column("seq").to_numpy()
    micro = table.column("micro_batch").to_numpy() if micro_batch is None else None
    streams: dict[tuple[str, int], list[int]] = {}
    for i, stream in enumerate(zip(runs, ranks.tolist())):
        streams.setdefault(stream, []).append(i)

    def settings(stream: tuple[str, int]) -> tuple[Any, int, bool]:
        stage = stages.get(stream, {})
        rng_seed = seed if seed is not None else stage.get("rng_seed", stage.get("seed", 0))
        stream_delay = delay if delay is not None else int(stage.get("delay", inferred_delay))
        return rng_seed, stream_delay, stage.get("on_nan", "keep") == "keep"

    ordered = {stream: _in_order(rows, seqs) for stream, rows in streams.items()}
    after_gap = _after_gaps(ordered, seqs, table.num_rows)
    results = []
    for policy in policies:
        keep = np.zeros(table.num_rows, dtype=bool)
        for stream, idx in ordered.items():
            rng_seed, stream_delay, nan_kept = settings(stream)
            rng = np.random.default_rng(rng_seed)
            fresh = policy.fresh()
            if micro is not None:
                cuts = np.flatnonzero(np.diff(micro[idx])) + 1
            else:
                assert micro_batch is not None
                cuts = np.arange(micro_batch, idx.size, micro_batch)
            for group in np.split(idx, cuts):
                first = int(seqs[group[0]])
                d = decide_rows(
                    fresh,
                    rng,
                    losses[group],
                    first,
                    group.size,
                    stream_delay,
                    nan_kept,
                    decided=(upstream[group], upstream_prob[group]) if upstream[group].any() else None,
                    unknown=unknown[group],
                )
                keep[group] = d.keep
        results.append(
            WhatIf(
                policy=repr(policy),
                samples=int(keep.size),
                kept=int(keep.sum()),
                logged_kept=int(logged.sum()),
                to_kept=int((keep & ~logged).sum()),
                to_dropped=int((~keep & logged).sum()),
                keep=keep,
                after_gap=int(after_gap.sum()),
                flips_after_gap=int((after_gap & (keep != logged)).sum()),
                no_loss=int(unknown.sum()),
                remembered=remembered,
            )
        )
    return results


def _remembered(table: Any, decided_here: np.ndarray) -> int:
    """Rows decided here (not before decode) from a loss a training step handed back in an earlier
    pass (``WhatIf.remembered``). Remembered forward losses (``stale``) count only in a run that
    had such losses: with forward scoring alone every scored loss is remembered, kept or not,
    and the memory is the same whatever the policy (the review of the change)."""
    if "source" not in table.column_names:
        return 0  # (a table read without it: nothing to say)
    source = np.asarray(table.column("source").to_pylist(), dtype=object)
    feedback = (source == "feedback") & decided_here
    if not feedback.any():
        return 0
    return int((feedback | ((source == "stale") & decided_here)).sum())


def warn_losses(no_loss: int, remembered: int, n: int, stacklevel: int = 2) -> None:
    """Say what a what-if over ``n`` decisions cannot be (found by review, 2026-12-06: over the
    default recipe's log, rows with no loss read as kept by every policy and remembered training
    losses as fresh scores, and nothing said so)."""
    if no_loss:
        warnings.warn(
            f"siftpipe: {no_loss} of {n} decisions have no loss in the log (reason 'unknown': "
            "samples never trained before, or decided after the cost guard stopped sifting): "
            "every policy keeps them here, as the logged run did, so keep rates are alike there "
            "(WhatIf.no_loss; the table says how many)",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    if remembered:
        warnings.warn(
            f"siftpipe: {remembered} of {n} decisions were made from losses training steps handed "
            "back in earlier passes (source 'feedback', and 'stale' with them), not scored as they "
            "were decided: the replay applies each policy to those same losses, but a policy that "
            "had trained other samples would have remembered other losses; read its keep rate as "
            "indicative, not as what it would have done (WhatIf.remembered)",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


def _in_order(rows: list[int], seqs: np.ndarray) -> np.ndarray:
    idx = np.asarray(rows)
    return idx[np.argsort(seqs[idx], kind="stable")]


def _after_gaps(ordered: Mapping[tuple[str, int], np.ndarray], seqs: np.ndarray, n: int) -> np.ndarray:
    """Rows decided after a gap in their stream's sequence numbers (a first row after seq 0
    included), warned about once: the replay draws and remembers nothing for the missing rows,
    so every later decision of the logged policy re-run may flip (found by review, 2026-12-06:
    parts dropped under on_full="drop" read as 730 flips of 2,700, with every logged decision
    right, and the only warning said that records were missing)."""
    after = np.zeros(n, dtype=bool)
    said = []
    for (run, rank), idx in ordered.items():
        order = seqs[idx]
        jumps = np.flatnonzero(np.diff(order) > 1)
        if order.size and order[0] > 0:
            first, missing = 0, (0, int(order[0]) - 1)
        elif jumps.size:
            first, missing = int(jumps[0]) + 1, (int(order[jumps[0]]) + 1, int(order[jumps[0] + 1]) - 1)
        else:
            continue
        after[idx[first:]] = True
        said.append(f"run={run} rank={rank} lacks seq {missing[0]}..{missing[1]}")
    if said:
        warnings.warn(
            f"siftpipe: {'; '.join(said[:3])}{' (and more)' if len(said) > 3 else ''}: the records "
            "are not in the log (lost, or dropped under on_full='drop': siftpipe log verify says "
            "which; or, before its first record, in another log: a run resumed into a new root "
            "starts at its checkpoint). The replay cannot redo their random draws and loss "
            "history, so the decisions after a gap are not the policy re-run: flips there do not "
            "mean that the logged policy decided otherwise (counted apart: flips_after_gap)",
            UserWarning,
            stacklevel=3,
        )
    return after


def format_whatif(results: Sequence[WhatIf], logged_keep_rate: float) -> str:
    """A small table of what-if results."""
    # (as decided: rows a pass was left before handing on count kept here, where summary reads
    # them as never trained)
    lines = [
        f"logged keep rate (as decided): {logged_keep_rate:.4f}",
        f"{'policy':<48} {'keep rate':>9} {'flips':>9}",
    ]
    gaps = any(r.after_gap for r in results)
    if gaps:
        lines[1] += f" {'after a gap':>12}"
    for r in results:
        line = f"{r.policy:<48} {r.keep_rate:>9.4f} {r.flips:>9}"
        lines.append(line + (f" {r.flips_after_gap:>12}" if gaps else ""))
    if gaps:
        lines.append(
            f"{results[0].after_gap} of {results[0].samples} decisions come after a gap in the log's "
            "sequence numbers: flips among them are not the policy's (see the warning)"
        )
    if results and results[0].no_loss:
        lines.append(
            f"{results[0].no_loss} of {results[0].samples} decisions have no loss in the log: every "
            "policy keeps them, as the logged run did"
        )
    return "\n".join(lines)


def dump_json(results: Sequence[WhatIf]) -> str:
    return json.dumps([r.as_dict() for r in results], indent=1)


def _in_worker() -> bool:
    """Whether this process is a DataLoader worker."""
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None
