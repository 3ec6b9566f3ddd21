"""Sifting before decode: DataLoader workers drop samples by key using a published score memory.

A sample dropped before decoding costs no read of its payload into an image, no decode and no
augmentation. The main process publishes its score memory (``Sifter.publish_memory(url)``, at the
end of each epoch, say); each worker's ``PreDecodeFilter`` loads the newest publication when it
starts iterating (every epoch: DataLoader workers restart, persistent ones call ``iter`` again) and
decides every sample it has a remembered loss for:

* the keep probability comes from the loss's percentile among all remembered losses
  (``percentile ** beta``, as ``RelativeProbabilistic``), and
* the draw is a hash of (seed, epoch, key), so the decision is the same in every process and in a
  resumed run, without sharing a random generator with the main process.

Samples it keeps carry ``__sift_prekept__ = 1`` (and their loss and probability), and the main
process's ``Sifter`` hands them on without deciding twice, recording them with reason
``predecode``. Samples it knows nothing about carry ``__sift_prekept__ = 0`` and are scored as
usual. Samples it drops never reach the main process: each worker writes their records into the
audit log's ``_predecode`` folder (``read_log(..., include_predecode=True)`` adds them, one
recording of each drop where a resumed job's workers recorded the epoch's drops again).

Freshness: decisions use the memory as of the last publication, so a sample's loss is at most one
epoch older than the live stage's (plus ``max_age`` epochs if the memory reuses stale losses).
"""

from __future__ import annotations

import hashlib
import io
import json
import operator
import secrets as _random
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

import numpy as np

from .._secrets import redact, redact_url, refuse_credentials_in_url, secret_values
from ..core.files import RETRY_TIMEOUT, check_retry_timeout, put_whole, retrying, storage_error
from ..core.memory import ScoreMemory, key_hashes, publication_checksum
from ..core.ranks import dist_info, rank_said
from ..core.rows import shard_key
from ..core.shardcounts import SharedCounters
from ..core.values import is_int, scalar_key
from ..core.vocab import PRE_KEPT, PRE_LOSS, PRE_PROB, loggable_text
from ..errors import ConfigError, MissingKeyError, PreDecodeWarning, SiftError

__all__ = ["PRE_KEPT", "PreDecodeFilter"]

#: What ``PreDecodeFilter.stats`` counts, in the order of its shared counters' cells.
_COUNTED = ("seen", "dropped", "kept", "unknown")
#: Publications a filter follows while loading one (each replaced, its file deleted, meanwhile)
_NEWER_TRIES = 8


def hash_uniform(seed: int, epoch: int, keys: Iterable[Any]) -> np.ndarray:
    """A uniform [0, 1) number per key, the same in every process: BLAKE2b of (seed, epoch, key)."""
    return (
        np.fromiter(
            (
                int.from_bytes(
                    hashlib.blake2b(f"{seed}:{epoch}:{k}".encode(), digest_size=8).digest(), "little"
                )
                for k in keys
            ),
            dtype=np.uint64,
        ).astype(np.float64)
        / 2.0**64
    )


class PreDecodeFilter:
    """A stage for DataLoader workers, before decode: drops samples by key from a published memory.

    Args:
        url: Where the main process publishes its memory (``Sifter.publish_memory(url)``).
        storage_options: fsspec options for ``url`` and for the audit records.
        key: How to find a sample's key: a field's name, or a function of the raw sample (such
            as ``sp.shard_key``); ``None`` (the default): as the stage that publishes keys its
            samples (its ``key`` when a field or ``sp.shard_key``, which the publication names;
            ``"__key__"`` otherwise), so that the losses it remembers are found. A stage keyed by
            a function of its own that gives other keys than ``__key__`` needs that function here
            (a pass that finds none of its keys says so: ``PreDecodeWarning``); a field that
            differs from the stage's key is a ``ConfigError`` when the publication loads (before
            2026-12-05 a stage keyed by ``sp.shard_key`` was looked up by ``__key__``: nothing
            was found, every sample passed on, nothing said).
        chunk: Samples looked up together (one vectorised lookup per chunk), >= 1.
        rank: The rank whose publications it reads (a publication names the rank that wrote
            it, and one of another rank is refused: two ranks publishing to one URL would mix
            their memories, draws and audit folders); ``None``: this process's rank
            (``torch.distributed``, else ``$RANK``, else 0) in the training process, read when
            it is first needed or the filter is copied to a DataLoader worker, so a filter made
            before ``init_process_group`` serves its own rank.
        retry_timeout: Seconds a worker reads the publication again, and writes its record of
            the samples it dropped again, while storage fails in a way that may pass (an
            outage, a 5xx answer), saying so once as a ``PreDecodeWarning``; then ``SiftError``.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        key: str | Callable[[Mapping[str, Any]], Any] | None = None,
        chunk: int = 64,
        rank: int | None = None,
        retry_timeout: float = RETRY_TIMEOUT,
    ) -> None:
        self.url = url.rstrip("/")
        self.retry_timeout = check_retry_timeout(retry_timeout)
        # s3fs would take s3://KEY:SECRET@bucket for a bucket named KEY:SECRET and name it in its
        # errors, and every DataLoader worker holds a copy of the URL
        refuse_credentials_in_url(self.url, ConfigError)
        # None: read from torch.distributed when needed (found 2026-12-05: read here, a filter
        # made before init_process_group in a spawned job served rank 0 on every rank)
        self._rank: int | None = None if rank is None else int(rank)
        self.storage_options = dict(storage_options or {})
        if key is not None and not isinstance(key, str) and not callable(key):
            raise ConfigError(
                f"PreDecodeFilter key must be a field's name or a function of a sample, got {key!r}"
            )
        self.key = key
        if not is_int(chunk, 1):
            # 0 handed nothing on and counted nothing; None read the whole source first (found
            # by review, 2026-12-05)
            raise ConfigError(f"PreDecodeFilter chunk must be a number of samples >= 1, got {chunk!r}")
        self.chunk = int(chunk)
        self._loaded: str | None = None  # version of the publication in memory
        self._memory: ScoreMemory | None = None
        self._sorted: np.ndarray = np.zeros(0)
        self._meta: dict[str, Any] = {}
        # the epoch of the pass a Sifter starts over this filter (follow_sifter_epoch: handed on
        # before the pass's DataLoader workers are made from copies of it); None: never told
        self._epoch: int | None = None
        # passes this copy of the filter began since it was last told the epoch: a second one in
        # a DataLoader worker is a persistent worker's next epoch, which nobody told it
        self._passes_since_told = 0
        # when the run of the Sifter over this filter began (follow_sifter_run): a publication
        # made before it is another run's; None: any publication is taken
        self._run_began: float | None = None
        # (the checkpoint's epoch, when the stage loaded it) after a resume (follow_sifter_resume)
        self._resumed: tuple[int, float] | None = None
        self._warned_other_run = False
        self._warned_rolled_back = False
        self._secrets: list[str] = []  # values never written to the records (set per pass)
        self._warned_missing = False
        self._warned_nothing_found = False
        self._found = [0, 0]  # this pass's lookups in a loaded publication: looked, found
        # what every copy of this filter decided (the training process's and each DataLoader
        # worker's, forked or spawned), added up where read: a worker's own dict died with it
        self._counts = SharedCounters(_COUNTED)
        #: Names this filter's records in the audit log, the same in every DataLoader worker it is
        #: copied to (forked or pickled) and new for a filter made again, by a resumed job say:
        #: a resumed job's workers drop the samples of the epoch again and record them again, and
        #: ``read_log`` keeps one recording of each (the filter of most records for it).
        self.recording = _random.token_hex(8)

    def __repr__(self) -> str:
        return f"PreDecodeFilter({self._shown()!r}, version={self._loaded!r})"

    @property
    def rank(self) -> int:
        """The rank whose publications this filter reads (see ``rank=``)."""
        rank = self._rank
        if rank is None:
            rank = dist_info()[0]
            if rank_said():
                self._rank = rank  # settled: a process's rank does not change
        return rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = int(value)

    def __getstate__(self) -> dict[str, Any]:
        # copied to a DataLoader worker (pickled in the training process): the worker, spawned,
        # has no process group, so it gets the rank the training process has now: reading it
        # settles it, once torch.distributed or $RANK says it (not before: a copy pickled then,
        # through mp.spawn's args, say, would serve rank 0 for good; review, 2026-12-05)
        self.rank  # noqa: B018
        return self.__dict__.copy()

    @property
    def stats(self) -> dict[str, int]:
        """Samples this filter saw, dropped, and passed on (``kept``: decided and kept;
        ``unknown``: no remembered loss, passed on to be scored), over all epochs, summed over
        every process that ran a copy of it: the training process and each DataLoader worker,
        forked or spawned, persistent or not (one loader iterating at a time). The drops are
        counted here even without an audit log to record them."""
        return self._counts.totals()

    def reset_stats(self) -> None:
        """Zero ``stats`` (while no DataLoader worker is running)."""
        self._counts.reset()

    def follow_sifter_epoch(self, epoch: int) -> None:
        """The epoch of the pass the ``Sifter`` over this filter starts: it hands it on before the
        pass (so that a ``DataLoader``'s fresh workers copy it) to every filter it can reach (in a
        ``WebDataset``/``DataPipeline``, a DataLoader's ``dataset``). Decisions draw for it and are
        recorded under it, and the losses' age is counted to it, as the stage counts it. Never told (a
        filter held where the stage does not look), or told too long ago (a persistent DataLoader
        worker's copy is told once, when the workers start: from its second pass on), or told an
        epoch older than the publication's, the filter takes the epoch after the publication's,
        which is right when each epoch's end publishes and wrong for an epoch that followed no
        publication: call ``set_epoch`` then (with persistent workers, publish every epoch)."""
        self._epoch = int(epoch)
        self._passes_since_told = 0

    def follow_sifter_run(self, began: float | None) -> None:
        """When the run of the ``Sifter`` over this filter began (unix seconds: when the Sifter
        was made, or, resumed, when the run its checkpoint is of began; ``None`` for a checkpoint
        written before 2026-12-05, which does not say): the stage hands it on, as it hands on its
        epoch. A publication made before then is another run's, at the same URL (a job started
        again from scratch): its losses come from another model, so the filter passes every
        sample on (``PreDecodeWarning``, once) until this run publishes its own."""
        self._run_began = began

    def follow_sifter_resume(self, resumed: tuple[int, float] | None) -> None:
        """The epoch of the checkpoint the ``Sifter`` over this filter resumed from, and when it
        loaded it (unix seconds; ``None``: not resumed): the stage hands it on with its run. A
        publication of a later epoch made before then is the resumed run's, from training the
        resume rolled back (found by review, 2026-12-05: taken, its losses decided the resumed
        epoch, recorded under an epoch the run had not reached), so the filter passes every
        sample on (``PreDecodeWarning``, once) until this job publishes its own."""
        self._resumed = None if resumed is None else (int(resumed[0]), float(resumed[1]))

    #: ``Sifter.set_epoch`` hands its epoch on through this too, to a filter in a pipeline given
    #: to ``watch_shards`` (a ``.sift()`` chain's): its DataLoader's workers start before the
    #: stage opens its pass, so the pass's own hand-over would come too late for them.
    follow_sifter_set_epoch = follow_sifter_epoch

    def set_epoch(self, epoch: int) -> None:
        """``follow_sifter_epoch``, for a dataset of your own that holds the filter where the
        stage does not look: call it with the ``Sifter``'s epoch before each pass's workers start."""
        self.follow_sifter_epoch(epoch)

    def epoch(self) -> int | None:
        """The epoch this filter decides for: the one the stage told it, unless that is stale (a
        persistent DataLoader worker's copy begins its next pass told nothing new, or the
        publication is newer than the epoch told), then the epoch after the publication's, as
        for a filter never told; ``None`` before any publication is loaded."""
        published = self._meta.get("epoch")
        if published is None:
            return self._epoch
        stale = self._epoch is None or self._passes_since_told > 1 or self._epoch < int(published)
        return int(published) + 1 if stale else self._epoch

    def _shown(self) -> str:
        return redact(redact_url(self.url), secret_values(self.storage_options))

    def _refresh(self) -> None:
        meta = self._read_latest()
        if meta is not None and self._ignored(meta):
            return
        if meta is None:
            # nothing published yet (the first epoch): pass everything on. Said once from the
            # second epoch on, as a mistyped URL or a server that cannot be reached reads the same
            self._memory, self._meta = None, {}
            if not self._warned_missing and self._epoch is not None and self._epoch > 0:
                self._warned_missing = True
                warnings.warn(
                    f"siftpipe: PreDecodeFilter finds no publication at {self._shown()}/latest.json "
                    f"in epoch {self._epoch}: every sample is passed on for the stage to decide. "
                    "Publish with Sifter.publish_memory(url) at each epoch's end, to the URL the "
                    "filter reads (or check that it can be reached)",
                    PreDecodeWarning,
                    stacklevel=3,
                )
            return
        for _ in range(_NEWER_TRIES):
            if meta["version"] == self._loaded:
                return
            file = meta["file"]
            named = f"the publication {self._shown()}/latest.json names {loggable_text(file)!r}, which"
            # sized to the losses it holds: every worker loads each publication. Retried while
            # storage fails in a way that may pass, as latest.json's read is (a 503 read as the
            # file deleted and stopped training at once: review, 2026-12-06)

            def load(file: str = file) -> ScoreMemory:
                return ScoreMemory.load(f"{self.url}/{file}", self.storage_options, lookups_only=True)

            try:
                memory = retrying(
                    load,
                    f"reading {loggable_text(file)!r}, which {self._shown()}/latest.json names",
                    self.retry_timeout,
                    _say,
                )
                break
            except ConfigError as exc:
                # (the file named no URL and advised passing one: review, 2026-12-06)
                raise ConfigError(
                    f"{named} is damaged ({exc}); publish again with Sifter.publish_memory(url)"
                ) from None
            except OSError as exc:
                # published again since latest.json was read, and the file it named deleted as
                # the publisher's keep= asks: the newer one is what to load, checked as the first
                # was (another run's, or rolled back: the review of 2026-12-06 found a newer one
                # of another job's taken without a word)
                newer = self._read_latest()
                if newer is not None and newer["version"] != meta["version"]:
                    if self._ignored(newer):
                        return
                    meta = newer
                    continue
                # (not the raw error: its text holds the URL, which may hold credentials)
                raise ConfigError(
                    f"{named} cannot be read ({type(exc).__name__}: "
                    f"{redact(str(exc), secret_values(self.storage_options, self.url))}): deleted "
                    "or moved since it was published? Publish again with Sifter.publish_memory(url)"
                ) from None
        else:
            raise ConfigError(
                f"the publication at {self._shown()}/latest.json was replaced {_NEWER_TRIES} times "
                "while this filter loaded it, each file deleted before it could be read: publish "
                "less often than workers start, or with publish_memory(..., keep=None)"
            )
        self._check_key(meta)
        self._memory = memory
        self._sorted = np.sort(memory.losses())
        self._meta = meta
        self._loaded = meta["version"]

    def _ignored(self, meta: Mapping[str, Any]) -> bool:
        """Whether ``meta``, a publication read, is not this run's to decide by (another run's,
        or one the resume rolled back): then nothing is loaded, and it is said once."""
        if self._other_run(meta):
            # another run's publication at this URL: nothing of it is this run's to decide by
            self._memory, self._meta, self._loaded = None, {}, None
            if not self._warned_other_run:
                self._warned_other_run = True
                warnings.warn(
                    f"siftpipe: PreDecodeFilter ignores the publication at {self._shown()}: "
                    "another run made it (one before this one, or a job running now that "
                    "publishes to this URL too), whose losses came from another model. Every "
                    "sample is passed on for the stage to decide until this run publishes its "
                    "own. Publish to a URL of each run's own (the run id in it), or resume that "
                    "run with load_state_dict to go on from it",
                    PreDecodeWarning,
                    stacklevel=4,
                )
            return True
        if self._rolled_back(meta):
            self._memory, self._meta, self._loaded = None, {}, None
            if not self._warned_rolled_back:
                self._warned_rolled_back = True
                assert self._resumed is not None
                warnings.warn(
                    f"siftpipe: PreDecodeFilter ignores the publication at {self._shown()}: it is "
                    f"of epoch {int(meta['epoch'])}, made before this job resumed from its "
                    f"checkpoint of epoch {self._resumed[0]}, by the run it resumed, from training "
                    "the resume rolled back. Every sample is passed on for the stage to decide "
                    "until this job publishes its own (at the end of this epoch)",
                    PreDecodeWarning,
                    stacklevel=4,
                )
            return True
        return False

    def _check_key(self, meta: Mapping[str, Any]) -> None:
        """Refuse a publication whose stage surely keys samples otherwise than this filter: by
        another field, or by ``sp.shard_key`` where the filter was given a field. (A stage keyed
        by a function of its own, or by a tuple's position, may well key by ``__key__``: the
        pass's lookups say so, ``_say_nothing_found``; found by the review of 2026-12-05 that such
        stages were refused.)"""
        spec = meta.get("key")
        if not isinstance(spec, Mapping) or not isinstance(self.key, str):
            return
        field, function = spec.get("field"), spec.get("function")
        if (field is not None and self.key != field) or function == "shard_key":
            said = f"the field {field!r}" if field is not None else "the function sp.shard_key"
            raise ConfigError(
                f"PreDecodeFilter finds samples by the field {self.key!r}, and the stage publishing "
                f"at {self._shown()} keys them by {said}: no loss it remembers would be found. "
                "Leave PreDecodeFilter's key out (it follows the stage's), or give it the stage's"
            )

    def _key_spec(self) -> str | Callable[[Mapping[str, Any]], Any]:
        """How this filter finds a sample's key now, a field or a function: its own ``key``, else
        the publication's (a field, or ``sp.shard_key``; ``__key__`` for a stage keyed by a
        function of its own)."""
        if self.key is not None:
            return self.key
        spec = self._meta.get("key")
        if not isinstance(spec, Mapping):
            return "__key__"
        if spec.get("function") == "shard_key":
            return shard_key
        return spec.get("field") or "__key__"

    def _say_nothing_found(self, looked: int) -> None:
        """Warn, once, of a pass whose ``looked`` lookups found nothing in a loaded publication:
        the stage keys samples otherwise than this filter (a function of its own)."""
        if self._warned_nothing_found or self._memory is None or not len(self._sorted):
            return
        self._warned_nothing_found = True
        epoch = self.epoch()
        if epoch is not None and not self._memory.usable_at(epoch):
            # its keys may all be there: every loss is too old for this epoch (found by review,
            # 2026-12-05: the warning blamed the key)
            published = int(self._meta.get("epoch", epoch))
            why = (
                "publish at every epoch's end (Sifter.publish_memory), or give the memory a larger max_age"
                if published < epoch - 1
                # published last epoch: its losses are older than that (a sample dropped before
                # decode is not trained, so its loss is not renewed; the review of the fix)
                else "a sample dropped before decode is not trained, so its loss is not renewed "
                "and ages each epoch: give the memory max_age=2 or more"
            )
            warnings.warn(
                f"siftpipe: PreDecodeFilter finds no loss in the publication at {self._shown()} "
                f"young enough for epoch {epoch}: the memory uses losses at most "
                f"max_age={self._memory.max_age} epoch(s) old (the publication is of epoch "
                f"{published}). The {looked} samples were passed on for the stage to decide; "
                f"{why}",
                PreDecodeWarning,
                stacklevel=3,
            )
            return
        warnings.warn(
            f"siftpipe: PreDecodeFilter found none of {looked} samples' keys in the publication at "
            f"{self._shown()} (it remembers {len(self._sorted)}): they were passed on for the stage "
            "to decide. Samples new to the memory are passed on so, as they should be; if these "
            "were seen before, the stage keys samples otherwise than this filter: give "
            "PreDecodeFilter(key=) the stage's key (its field, or the function it was given)",
            PreDecodeWarning,
            stacklevel=3,
        )

    def _other_run(self, meta: Mapping[str, Any]) -> bool:
        """Whether another run than this filter's Sifter's (told, ``follow_sifter_run``) made
        the publication ``meta``. The run that published says when it began (since 2026-12-05):
        another value is another run, one running now included (found by review: two jobs
        publishing to one URL decided each other's samples and wrote into each other's audit
        logs); a publication that does not say is another run's if it is older than this run."""
        began = self._run_began
        if began is None:
            return False
        said = meta.get("run_began")
        if said is not None:
            return not isinstance(said, int | float) or float(said) != began
        return float(meta.get("published") or began) < began

    def _rolled_back(self, meta: Mapping[str, Any]) -> bool:
        """Whether ``meta`` is a publication of an epoch after the checkpoint this filter's
        Sifter resumed from, made before it did (``follow_sifter_resume``)."""
        if self._resumed is None:
            return False
        epoch, loaded = self._resumed
        published = meta.get("published")
        made_since = isinstance(published, int | float) and float(published) >= loaded
        return int(meta["epoch"]) > epoch and not made_since

    def _read_latest(self) -> dict[str, Any] | None:
        """The publication ``latest.json`` names (checked), or None when there is none."""
        import fsspec

        def read() -> bytes | None:
            for attempt in range(8):
                try:
                    with fsspec.open(f"{self.url}/latest.json", "rb", **self.storage_options) as f:
                        return bytes(f.read())
                except FileNotFoundError:
                    return None
                except OSError as exc:
                    # replaced while read: s3fs reads an object with the ETag it found first and
                    # says FileExpired when a publication replaced it between (found by review,
                    # 2026-12-05: a DataLoader worker died with it): read the new one
                    if type(exc).__name__ != "FileExpired":
                        raise
                time.sleep(0.05 * (attempt + 1))
            raise SiftError(
                f"the publication at {self._shown()}/latest.json was replaced 8 times while this "
                "worker read it (over about 2 s): publish the score memory once an epoch, not "
                "in a loop"
            )

        raw = retrying(
            read, f"reading the publication at {self._shown()}/latest.json", self.retry_timeout, _say
        )
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            meta["version"], meta["file"] = str(meta["version"]), str(meta["file"])
            int(meta["epoch"]), int(meta["seed"]), float(meta["beta"])
            # publications before 2026-12-05 hold no checksum and are read as they are
            recorded = meta.get("sha256")
            if recorded is not None and recorded != publication_checksum(meta):
                raise ValueError("its fields differ from the SHA-256 it was written with")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"the publication at {self._shown()}/latest.json is damaged ({type(exc).__name__}: "
                f"{exc}); publish again with Sifter.publish_memory(url)"
            ) from None
        published = meta.get("rank")
        if published is not None and published != self.rank:
            raise ConfigError(
                f"the publication at {self._shown()}/latest.json was written by rank {published}, "
                f"and this filter serves rank {self.rank}: ranks publishing to one URL mix their "
                "memories, draws and audit folders. Give each rank its own URL (publish_memory and "
                "PreDecodeFilter both at f'{url}/rank={rank}')"
            )
        return meta

    def __call__(self, samples: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        self._passes_since_told += 1
        self._refresh()
        it = iter(samples)
        dropped: list[dict[str, Any]] = []
        worker = _worker_id()
        # the records' URLs as the stage's audit log writes them: no credentials, and none of
        # the values of credential-like storage options and environment variables
        self._secrets = secret_values(self.storage_options, self.url)
        self._found = [0, 0]
        try:
            while batch := list(islice(it, self.chunk)):
                yield from self._decide(batch, dropped, worker)
        finally:
            self._write_dropped(dropped, worker)
        looked, found = self._found
        if looked >= self.chunk and not found:
            self._say_nothing_found(looked)

    def _decide(
        self, batch: list[dict[str, Any]], dropped: list[dict[str, Any]], worker: int
    ) -> Iterator[dict[str, Any]]:
        spec = self._key_spec()
        key_of = operator.itemgetter(spec) if isinstance(spec, str) else spec
        try:
            # a tensor key as its value, as the stage and the audit log take it (tensor(5): 5)
            keys = [scalar_key(key_of(s)) for s in batch]
        except (KeyError, TypeError):
            if isinstance(spec, str):
                what = f"a sample has no field {spec!r}"
            else:
                what = f"its key function {getattr(spec, '__name__', spec)!r} cannot read a sample"
            raise MissingKeyError(
                f"PreDecodeFilter finds samples by key but {what}; place it right after the tar "
                "reader, where '__key__' (and '__url__') are present"
            ) from None
        # this process's row: seen, dropped, kept, unknown; each counted as it is decided, seen
        # too: a consumer may stop inside the chunk (found by review, 2026-12-05: the whole chunk
        # was counted seen, so seen exceeded dropped + kept + unknown)
        counts = self._counts.row()
        memory = self._memory
        if memory is None or not self._sorted.size:
            for s in batch:
                counts[0] += 1
                counts[3] += 1
                yield {**s, PRE_KEPT: 0, PRE_LOSS: float("nan"), PRE_PROB: float("nan")}
            return
        epoch = self.epoch()
        assert epoch is not None  # a publication is loaded
        # key_hashes, not the memory's cache: a worker sees each key once per epoch, and the memory is
        # reloaded with each publication, so a cache would only cost memory
        loss, _ = memory.lookup(key_hashes(keys), epoch)
        known = ~np.isnan(loss)
        self._found[0] += len(keys)
        self._found[1] += int(known.sum())
        values = self._sorted
        pct = (np.searchsorted(values, loss, "left") + np.searchsorted(values, loss, "right")) / (
            2.0 * values.size
        )
        prob = np.where(known, pct ** float(self._meta["beta"]), 1.0)
        keep = hash_uniform(int(self._meta["seed"]), epoch, keys) < prob
        for s, k, kn, kp, lo, pr in zip(batch, keys, known, keep, loss, prob):
            counts[0] += 1
            if not kn:
                counts[3] += 1
                yield {**s, PRE_KEPT: 0, PRE_LOSS: float("nan"), PRE_PROB: float("nan")}
            elif kp:
                counts[2] += 1
                yield {**s, PRE_KEPT: 1, PRE_LOSS: float(lo), PRE_PROB: float(pr)}
            else:
                counts[1] += 1
                dropped.append(
                    {
                        "key": loggable_text(str(k)),
                        "url": None
                        if s.get("__url__") is None
                        else loggable_text(redact(redact_url(str(s["__url__"])), self._secrets)),
                        "loss": float(lo),
                        "prob": float(pr),
                        "epoch": epoch,
                    }
                )

    def _write_dropped(self, dropped: list[dict[str, Any]], worker: int) -> None:
        """Record the samples dropped here in the audit log's ``_predecode`` folder (one Parquet file)."""
        audit = self._meta.get("audit")
        if not dropped or not audit:
            return
        import fsspec
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                "worker": pa.array(np.full(len(dropped), worker, np.int32)),
                "seq": pa.array(np.full(len(dropped), -1, np.int64)),
                "epoch": pa.array([d["epoch"] for d in dropped], pa.int32()),
                "key": pa.array([d["key"] for d in dropped], pa.string()),
                "url": pa.array([d["url"] for d in dropped], pa.string()),
                "loss": pa.array([d["loss"] for d in dropped], pa.float64()),
                "score": pa.nulls(len(dropped), pa.float32()),
                "prob": pa.array([d["prob"] for d in dropped], pa.float32()),
                "kept": pa.array(np.zeros(len(dropped), bool)),
                "weight": pa.array(np.ones(len(dropped), np.float32)),
                "reason": pa.array(["predecode"] * len(dropped), pa.string()),
                "source": pa.array(["feedback"] * len(dropped), pa.string()),
                "micro_batch": pa.array(np.full(len(dropped), -1, np.int64)),
                "model_version": pa.array(np.full(len(dropped), -1, np.int64)),
                "time": pa.array(np.full(len(dropped), time.time())),
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        name = (
            f"epoch={dropped[0]['epoch']}-worker={worker}-filter={self.recording}-"
            f"{_random.token_hex(4)}.parquet"
        )
        fs, path = fsspec.core.url_to_fs(f"{audit['directory']}/_predecode/{name}", **self.storage_options)
        what = (
            f"recording the samples worker {worker} dropped before decode ({len(dropped)}) in the "
            f"audit log's {redact(redact_url(str(audit['directory'])), secret_values(self.storage_options))}"
        )
        # (retried while storage fails in a way that may pass, as the audit log's writes are)
        try:
            retrying(
                lambda: put_whole(fs, path, sink.getvalue()),  # a kill mid-write leaves no truncated part
                what,
                self.retry_timeout,
                _say,
            )
        except OSError as exc:
            # (a bare "[Errno 28] No space left on device" named nothing: review, 2026-12-06)
            then = "; these drops are not in the audit log (verify does not see them missing)"
            raise storage_error(what, exc, then) from None


def _say(message: str) -> None:
    warnings.warn(message, PreDecodeWarning, stacklevel=4)


def _worker_id() -> int:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return -1 if info is None else int(info.id)
