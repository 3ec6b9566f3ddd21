"""WebDataset integration: ``.sift()`` in fluid chains, and shards streamed from any fsspec URL.

The pattern (sifting needs the live model, which only the training process has)::

    import siftpipe as sp
    from siftpipe.webdataset import WebDataset, WebLoader

    dataset = (
        WebDataset("s3://bucket/train-{000000..000099}.tar", shardshuffle=100,
                   storage_options={"endpoint_url": "https://..."})   # or the AWS environment
        .decode()                       # in the DataLoader workers
        .map(augment)
        .batched(256, collation_fn=default_collate)
    )
    loader = (
        WebLoader(dataset, batch_size=None, num_workers=8)   # batches -> the training process
        # the sifter re-batches the kept rows to 128 (output_batch): that resumes exactly, where
        # a later .unbatched()...batched(128) holds rows no checkpoint of the sifter records
        .sift(sp.Sifter(model, "cross_entropy", batched=True, micro_batch=None, output_batch=128))
    )

``WebDataset`` and ``WebLoader`` are webdataset's classes with a ``.sift()`` method that survives
every fluid call (``decode``, ``map``, ``batched``, ``to_tuple``, ...: each returns a copy of the
same class). ``install()`` adds ``.sift`` to webdataset's own ``FluidInterface`` instead (opt-in;
importing this module changes nothing in webdataset). The ``Sifter`` itself is also a plain
pipeline stage: ``wds.DataPipeline(..., sifter)`` or ``pipeline.compose(sifter)``.
"""

from __future__ import annotations

import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import webdataset as wds
from webdataset import autodecode, filters, shardlists, tariterators
from webdataset import cache as wds_cache

from ..audit.replay import Replay
from ..core.ledger import TAIL
from ..core.resume import check_tail, tail_entry
from ..core.stage import Sifter
from ..errors import (
    ConfigError,
    ResumeError,
    SampleError,
    ShardError,
    SiftInWorkerError,
)
from ..streaming import handlers
from ..streaming.handlers import *  # noqa: F403  (the handler names, listed once in siftpipe.handlers)
from ..streaming.handlers import reraise_exception
from ..streaming.opener import (
    MAX_MEMBER_BYTES,
    MAX_SAMPLE_BYTES,
    OpenerOptions,
    ShardOpener,
    ShardReader,
    ShardStats,
    count_here,
    find_shard_counts,
    merge_shard_stats,
    redact_options,
    redact_url,
    shard_opener,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "FLUID_METHODS",
    "ShardOpener",
    "ShardReader",
    "ShardStats",
    "SiftFluid",
    "SiftStage",
    "WebDataset",
    "WebLoader",
    "install",
    "is_installed",
    "uninstall",
]
__all__ += handlers.__all__


class SiftStage:
    """A pipeline stage that runs a ``Sifter`` over its input.

    After ``sifter.load_state_dict(state)`` of a checkpoint whose source was not tracked, the
    next pass first skips the ``state["consumed"]`` input items the checkpoint had finished
    (they are read again and dropped: the pipeline up to here must give the same items in the
    same order as before, e.g. ``shardshuffle=False`` or a fixed ``seed``), so resuming a
    WebDataset chain is ``chain.sifter.load_state_dict(state)`` and iterating it again.
    """

    def __init__(self, sifter: Sifter) -> None:
        if not isinstance(sifter, Sifter):
            raise ConfigError(f"SiftStage needs a siftpipe.Sifter, got {type(sifter).__name__}")
        self.sifter = sifter
        # a resume skips the items a checkpoint finished by their count: its state names the last
        # of them by (key, shard), noted as each group is read, which the skip compares
        sifter._ledger.record_tail()
        #: Why no checkpoint can resume a pass of this stage (None: it can): the pipeline holding
        #: it cuts its output into epochs (``.with_epoch(n)``) or repeats its passes
        #: (``.repeat()``), outside the stage's state
        self.cut: str | None = None
        self._warned_cut = False
        #: What comes before the stage draws shards at random by design (webdataset's
        #: ``resampled=True``): it cannot be read again as it was, so no pass resumes inside
        self.random_source = False

    def __call__(self, source: Iterable[Any]) -> Iterator[Any]:
        skip = self.sifter.resume_from
        if self.cut:
            if skip is not None:
                raise ResumeError(self.cut + "; this resume would hand on other batches than the run did")
            if not self._warned_cut:
                self._warned_cut = True
                warnings.warn(f"siftpipe: {self.cut}", UserWarning, stacklevel=2)
        restore = self.sifter._passes.restore
        # (rows decided before the checkpoint are read again too: a resume in the first items)
        inside = skip is not None and (skip > 0 or bool(restore and restore.get("pending")))
        if inside and self.random_source:
            raise ResumeError(
                f"the checkpoint resumes inside a pass ({skip} input item(s) finished before it, "
                "the next read again), but the shards before the "
                "stage are drawn at random by design (webdataset's resampled=True mixes the process "
                "id, the time and os.urandom into its seed): they cannot be read again as they were. "
                "Resume from checkpoints taken between passes (set_epoch at each), or read the "
                "shards with siftpipe's ShardSource and SiftNode, whose state holds the position"
            )
        if skip:
            source = _skip(iter(source), skip, self.sifter, restore)
        return self.sifter(source)

    def __repr__(self) -> str:
        return f"SiftStage({self.sifter!r})"


_CUT = (
    "a pipeline that holds .sift() is cut into epochs by .with_epoch(n) on the pipeline (or "
    ".repeat(nbatches=n)), which counts the stage's output outside its state (webdataset's islice "
    "over passes repeated for ever): a checkpoint cannot say where such an epoch stood, so it "
    "cannot resume. Bound the input instead (.with_epoch(n) on the WebDataset that the loader's "
    "workers read: each pass the stage sees then ends with it), or count steps with "
    "siftpipe.fixed_steps"
)
_REPEATED = (
    "a pipeline that holds .sift() is repeated by .repeat(nepochs) on the pipeline, which runs "
    "several passes of the stage in one iteration and counts them outside its state: a checkpoint "
    "cannot say which of them it stood in, so it cannot resume (the resumed iteration would run "
    "them all again after the rest of the checkpoint's pass). Iterate the pipeline once per epoch "
    "instead (for epoch in range(n): for batch in loader: ...)"
)


_SLICED = (
    "a pipeline that holds .sift() is cut by .slice(...) after it, which counts the stage's output "
    "outside its state: a checkpoint cannot say where the slice stood, so it cannot resume (the "
    "resumed iteration would hand on a whole slice after the checkpoint). Slice the input before "
    ".sift() instead, or count steps with siftpipe.fixed_steps"
)


def _cut(pipeline: Any) -> None:
    """Mark the sift stages of ``pipeline`` (a DataPipeline) as cut into epochs by it
    (``with_epoch``, ``repeat(nbatches=)``), or repeated a given number of times in one iteration
    (``repeat(nepochs)``; found by review, 2026-12-05: ``.repeat`` was not noticed, and resumed
    silently wrong), also those of the pipelines inside it (a ``WebLoader`` around a dataset that
    holds the stage, read in this process), and those followed by webdataset's ``.slice()``, which
    cuts each pass (found by review, 2026-12-05). Repeated for ever and not cut, the passes after
    a resumed one are the uninterrupted run's: nothing to mark."""
    repetitions = getattr(pipeline, "repetitions", 1)
    cut = getattr(pipeline, "nsamples", 0) > 0 and repetitions != 1
    if cut or 1 < repetitions < sys.maxsize:
        _mark(pipeline, _CUT if cut else _REPEATED)
    stages = getattr(pipeline, "pipeline", None)
    if isinstance(stages, list):
        # the stages (and the pipelines they read: a WebLoader's DataLoader) before a .slice()
        last = max((i for i, stage in enumerate(stages) if _slices(stage)), default=0)
        if last:
            _mark(pipeline, _SLICED, upto=last)


def _attr(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)``, also where reading it raises (a stage of one's own)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _slices(stage: Any) -> bool:
    """Whether ``stage`` is webdataset's ``slice`` filter (``.slice(...)``)."""
    return _attr(stage, "f") is islice and isinstance(_attr(stage, "args"), tuple)


def _mark(pipeline: Any, why: str, depth: int = 0, upto: int | None = None) -> None:
    """Tell the sift stages in ``pipeline`` (its first ``upto`` stages, if given) and in the
    pipelines they read, ``why`` no checkpoint can resume their passes."""
    stages = _attr(pipeline, "pipeline")
    if depth > 8 or not isinstance(stages, list):
        return
    for i, stage in enumerate(stages[:upto]):
        if isinstance(stage, Sifter):
            # a bare .compose(sifter): the stage .sift() adds, which knows it is cut (a
            # Sifter called directly would resume such an epoch silently wrong)
            stage = stages[i] = SiftStage(stage)
        if isinstance(stage, SiftStage):
            if stage.cut is None or why is not _SLICED:
                stage.cut = why
            continue
        inner = _attr(stage, "dataset")  # a DataLoader (WebLoader's first stage)
        _mark(inner if inner is not None and inner is not stage else stage, why, depth + 1)


def _stage_for(pipeline: Any, sifter: Sifter) -> SiftStage:
    """The stage ``.sift(sifter)`` (or ``.compose(sifter)``) adds at the end of ``pipeline``: its
    sifter watching the pipeline's shards, told whether they are drawn at random."""
    sifter.watch_shards(pipeline)
    stage = SiftStage(sifter)
    stage.random_source = _random_shards(pipeline)
    return stage


def _random_shards(pipeline: Any, depth: int = 0) -> bool:
    """Whether ``pipeline`` (a DataPipeline, a DataLoader over one) draws its shards at random
    by design: webdataset's ``ResampledShards`` without ``deterministic=True``."""
    if depth > 8:
        return False
    if isinstance(pipeline, shardlists.ResampledShards):
        return not pipeline.deterministic
    inner = getattr(pipeline, "dataset", None)  # a DataLoader (WebLoader's first stage)
    if inner is not None and inner is not pipeline and _random_shards(inner, depth + 1):
        return True
    stages = getattr(pipeline, "pipeline", None)
    return isinstance(stages, list) and any(_random_shards(stage, depth + 1) for stage in stages)


def _skip(it: Iterator[Any], n: int, sifter: Sifter, state: Mapping[str, Any] | None) -> Iterator[Any]:
    last: deque[Any] = deque(maxlen=TAIL)  # the last items skipped, compared with the state's tail
    got = 0
    for item in islice(it, n):
        last.append(item)
        got += 1
    if got < n:
        raise ResumeError(
            f"resuming needs to skip the {n} input items the checkpoint had finished "
            f"(state['consumed']), but the pipeline ended after {got}: it must give the same items "
            "in the same order as before the checkpoint (shardshuffle=False or a fixed seed, same "
            "shards, same workers and batch sizes)"
        )
    entries = [tail_entry(item, sifter.batched, sifter.key) for item in last]  # never handed on
    if state is not None:
        check_tail(entries, list(last), state)
    sifter._ledger.finished(entries)  # a state taken soon after names them too
    yield from it


def _make_sifter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sifter:
    if len(args) == 1 and not kwargs and isinstance(args[0], Sifter):
        return args[0]
    if any(isinstance(a, Sifter) for a in (*args, *kwargs.values())):
        raise ConfigError(
            ".sift() takes either one Sifter, or the Sifter's constructor arguments "
            "(model, scorer, policy, micro_batch=..., ...), not both"
        )
    if not args and not kwargs:
        raise ConfigError(".sift() needs a Sifter, or the Sifter's arguments: .sift(model, scorer, ...)")
    return Sifter(*args, **kwargs)


class SiftFluid:
    """Fluid-interface methods that siftpipe adds to webdataset pipelines.

    Mixed into ``WebDataset`` and ``WebLoader`` here, or added to webdataset's own
    ``FluidInterface`` by ``install()`` (every method named in ``FLUID_METHODS``).
    """

    def sift(self, *args: Any, **kwargs: Any) -> Any:
        """Append a sift stage: ``.sift(sifter)`` or ``.sift(model, scorer, policy, ...)``.

        Returns a copy of this pipeline (same class) with the stage at its end; the copy's
        ``.sifter`` attribute is the ``Sifter`` (for ``state_dict()``, ``stats``, resuming).
        The stage must run in the training process: after the ``WebLoader``, never inside a
        dataset that DataLoader workers iterate (that raises ``SiftInWorkerError``).
        """
        sifter = _make_sifter(args, kwargs)
        result = self.compose(_stage_for(self, sifter))  # type: ignore[attr-defined]
        result.sifter = sifter
        _cut(result)  # a .with_epoch(n) before .sift() carries over to the copy
        return result

    def compose(self, *args: Any) -> Any:
        """webdataset's ``compose``; a ``Sifter`` composed in (``.compose(sifter)``) after or
        before ``.with_epoch(n)`` becomes the stage ``.sift()`` adds, which knows the pipeline
        cuts its output into epochs (a bare Sifter resumed such an epoch silently wrong)."""
        # a bare Sifter becomes the stage .sift() adds, which skips the items a resumed pass
        # had finished (found by review, 2026-12-05: composed bare, it could not resume)
        stages = [_stage_for(self, a) if isinstance(a, Sifter) else a for a in args]
        result = super().compose(*stages)  # type: ignore[misc]
        _cut(result)
        return result

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> Any:
        """webdataset's ``with_epoch``; on a pipeline that holds ``.sift()``, its stage learns
        that the pipeline cuts its output into epochs, which no checkpoint can resume (it warns
        once when a pass opens, and refuses a resume with ``ResumeError``)."""
        return _with_epoch(self, nsamples, nbatches)

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> Any:
        """webdataset's ``repeat``; on a pipeline that holds ``.sift()``, its stage learns that
        the pipeline repeats its passes (or cuts them, with ``nbatches``) outside its state, which
        no checkpoint can resume (``with_epoch``'s warning and ``ResumeError``)."""
        return _repeat(self, nepochs, nbatches)

    def shard_stats(self) -> ShardStats:
        """Shard counters of this pipeline's shard readers, summed over every process that read
        through them: the training process and every DataLoader worker (``ShardStats``, with the
        URLs of the skipped shards in ``skipped_urls``)."""
        return merge_shard_stats(find_shard_counts(self))

    def replay(
        self, url: str | Replay, storage_options: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """Append a replay stage: hand on exactly the samples a logged run kept, with no model.

        ``url`` is the audit log's root (or a ``siftpipe.Replay``); the other arguments are
        ``Replay``'s (``run=``, ``on_missing=``, ...). Replay matches single samples by key: put it
        where the stream holds samples (before ``.batched()``, or after ``.unbatched()``). The
        copy's ``.replayer`` attribute is the ``Replay`` (for ``stats``, ``set_epoch``).
        """
        replayer = url if isinstance(url, Replay) else Replay(url, storage_options, **kwargs)
        result = self.compose(replayer)  # type: ignore[attr-defined]
        result.replayer = replayer
        return result


_SKIP_HINT = (
    "or pass handler=warn_and_continue to this call (.decode(handler=...), .to_tuple(handler=...)) "
    "to skip such samples, "
    "counted in shard_stats().samples_skipped"
)


def _where(sample: Any) -> tuple[Any, Any, str]:
    if not isinstance(sample, Mapping):
        return None, None, "a sample that is not a dict"
    key, url = sample.get("__key__"), sample.get("__url__")
    return key, url, f"sample {key!r} of shard {redact_url(str(url))}"


class _Decode:
    """webdataset's Decoder, with errors that name the shard, the sample and the field."""

    def __init__(self, decoder: Callable[[Any], Any]) -> None:
        self.decoder = decoder

    def __call__(self, sample: Any) -> Any:
        try:
            return self.decoder(sample)
        except ShardError:
            raise
        except Exception as exc:
            key, url, where = _where(sample)
            field = getattr(exc, "k", None)
            cause = exc.__cause__ if isinstance(exc, autodecode.DecodingError) and exc.__cause__ else exc
            err = SampleError(
                f"decoding field {field!r} of {where} failed: {type(cause).__name__}: {cause}; the "
                f"shard holds bad data for it: rewrite the shard, give .decode() a decoder for it, "
                + _SKIP_HINT,
                url=None if url is None else redact_url(str(url)),
                key=key,
                kind="corrupt",
                field=field,
            )
            # as webdataset's DecodingError: a handler may read the sample (exn.sample["__key__"])
            err.sample = sample  # type: ignore[attr-defined]
            raise err from cause


class _ToTuple:
    """webdataset's ``to_tuple``, with errors that name the shard, the sample and the missing field."""

    def __init__(self, fields: tuple[Any, ...], missing_is_error: bool, none_is_error: bool | None) -> None:
        if len(fields) == 1 and isinstance(fields[0], str) and " " in fields[0]:
            fields = tuple(fields[0].split())
        self.fields = fields
        self.missing_is_error = missing_is_error
        self.none_is_error = missing_is_error if none_is_error is None else none_is_error

    def __call__(self, sample: Any) -> tuple[Any, ...]:
        out = []
        for spec in self.fields:
            names = spec.split(";") if isinstance(spec, str) else list(spec)
            value = next((sample[n] for n in names if n in sample), None)
            missing = not any(n in sample for n in names)
            if (missing and self.missing_is_error) or (value is None and self.none_is_error):
                key, url, where = _where(sample)
                have = sorted(k for k in sample if not (k.startswith("__") and k.endswith("__")))
                what = (
                    f"has no field {spec!r} (it has {have})"
                    if missing
                    else f"holds None in field {spec!r} (none_is_error=True; it has {have})"
                )
                raise SampleError(
                    f"{where} {what}; check the names given to "
                    f".to_tuple() against the shard's members (alternatives: 'jpg;png'), " + _SKIP_HINT,
                    url=None if url is None else redact_url(str(url)),
                    key=key,
                    kind="missing_field",
                    field=str(spec),
                )
            out.append(value)
        return tuple(out)


class _SampleHandler:
    """The pipeline's handler for a bad sample: counts it as skipped when the handler goes on."""

    def __init__(self, handler: Callable[[BaseException], bool], counts: list[Any]) -> None:
        self.handler = handler
        self.counts = counts

    def __call__(self, exn: BaseException) -> bool:
        go_on = self.handler(exn)  # reraise_exception raises here
        count_here("samples_skipped")
        for counts in self.counts:
            counts.add("samples_skipped")
        return go_on


#: Methods of ``SiftFluid`` that ``install()`` adds to webdataset's ``FluidInterface``.
FLUID_METHODS: tuple[str, ...] = ("sift", "replay")


def install() -> None:
    """Add ``.sift`` (every method of ``FLUID_METHODS``) to webdataset's ``FluidInterface``,
    so that ``wds.WebDataset(...)...sift(sifter)`` works on webdataset's own classes, and wrap
    ``DataPipeline.with_epoch`` so that a sift stage learns of it (``SiftFluid.with_epoch``).

    Opt-in and idempotent; ``uninstall()`` undoes it. Raises ``ConfigError`` rather than
    replacing a method of that name that is not siftpipe's.
    """
    for name in FLUID_METHODS:
        ours = SiftFluid.__dict__[name]
        current = wds.FluidInterface.__dict__.get(name)
        if current is ours:
            continue
        if current is not None or hasattr(wds.FluidInterface, name):
            raise ConfigError(
                f"webdataset's FluidInterface already has a .{name} that is not siftpipe's; not "
                f"replacing it: use siftpipe.webdataset.WebDataset/WebLoader instead"
            )
        setattr(wds.FluidInterface, name, ours)
    if wds.DataPipeline.__dict__.get("with_epoch") is _WDS_WITH_EPOCH:
        # webdataset's own with_epoch and repeat, so that its classes' stages learn of them as
        # siftpipe's do (SiftFluid.with_epoch): DataPipeline's come before FluidInterface's
        wds.DataPipeline.with_epoch = _with_epoch
    if wds.DataPipeline.__dict__.get("repeat") is _WDS_REPEAT:
        wds.DataPipeline.repeat = _repeat
    if wds.DataPipeline.__dict__.get("compose") is _WDS_COMPOSE:
        # and compose, which .slice() goes through: a stage learns of a slice after it
        wds.DataPipeline.compose = _compose


def uninstall() -> None:
    """Remove what ``install()`` added (and nothing else); a no-op if it was not installed."""
    for name in FLUID_METHODS:
        if wds.FluidInterface.__dict__.get(name) is SiftFluid.__dict__[name]:
            delattr(wds.FluidInterface, name)
    if wds.DataPipeline.__dict__.get("with_epoch") is _with_epoch:
        wds.DataPipeline.with_epoch = _WDS_WITH_EPOCH
    if wds.DataPipeline.__dict__.get("repeat") is _repeat:
        wds.DataPipeline.repeat = _WDS_REPEAT
    if wds.DataPipeline.__dict__.get("compose") is _compose:
        wds.DataPipeline.compose = _WDS_COMPOSE


_WDS_WITH_EPOCH = wds.DataPipeline.__dict__.get("with_epoch")


def _with_epoch(self: Any, *args: Any, **kwargs: Any) -> Any:
    """webdataset's ``DataPipeline.with_epoch``, then ``_cut`` (what ``install()`` puts there)."""
    result = _WDS_WITH_EPOCH(self, *args, **kwargs)  # type: ignore[misc]
    _cut(result)
    return result


_WDS_REPEAT = wds.DataPipeline.__dict__.get("repeat")
_WDS_COMPOSE = wds.DataPipeline.__dict__.get("compose")


def _compose(self: Any, *args: Any) -> Any:
    """webdataset's ``DataPipeline.compose``, then ``_cut`` (what ``install()`` puts there)."""
    result = _WDS_COMPOSE(self, *args)  # type: ignore[misc]
    _cut(result)
    return result


def _repeat(self: Any, *args: Any, **kwargs: Any) -> Any:
    """webdataset's ``DataPipeline.repeat``, then ``_cut`` (what ``install()`` puts there)."""
    result = _WDS_REPEAT(self, *args, **kwargs)  # type: ignore[misc]
    _cut(result)
    return result


def is_installed() -> bool:
    """Whether ``install()`` is in effect."""
    return all(wds.FluidInterface.__dict__.get(n) is SiftFluid.__dict__[n] for n in FLUID_METHODS)


def expand_urls(urls: Any) -> list[str]:
    if isinstance(urls, str):
        expanded = shardlists.expand_urls(urls)
    else:
        try:
            expanded = list(urls)
        except TypeError:
            raise ConfigError(
                f"shard URLs must be a brace pattern ('prefix-{{000000..000009}}.tar'), a list of "
                f"URLs or write_shards' result, got a {type(urls).__name__}"
            ) from None
    if not expanded:
        raise ConfigError(
            f"no shard URLs in {urls!r}: pass a brace pattern such as 'prefix-{{000000..000009}}.tar'"
        )
    for url in expanded:
        if not isinstance(url, str):
            raise ConfigError(f"shard URLs must be strings, got a {type(url).__name__}")
    return expanded


class WebDataset(SiftFluid, wds.WebDataset):
    """webdataset's ``WebDataset`` reading shards through fsspec, with ``.sift()``.

    Takes webdataset's arguments (``shardshuffle``, ``resampled``, ``nodesplitter``,
    ``workersplitter``, ``select_files``, ``rename_files``, ``empty_check``, ``seed``, ...)
    with the same meaning, plus:

    Args:
        storage_options: fsspec options for the shards' filesystem: for S3 ``endpoint_url``,
            ``key``/``secret``/``token``, ``profile``, ``anon``, ``client_kwargs``,
            ``config_kwargs``; ``None``: the standard AWS environment and config files.
            Filesystems are created lazily in each DataLoader worker, never shipped to it.
        handler: What to do with a shard that cannot be opened or read after retries:
            ``reraise_exception`` (default), ``warn_and_continue`` (skip it with a
            ``ShardWarning``), ... As in webdataset, it covers reading shards only: ``.decode()``
            and ``.to_tuple()`` take their own ``handler=`` and re-raise by default.
        retries: Retries of a failed open or read (transient errors: connection errors,
            timeouts, 5xx and throttling answers) with exponential backoff; a read that fails
            mid-shard reopens the object at the same byte offset.
        backoff: Seconds before the first retry (doubled each time, with jitter, up to
            ``max_backoff`` seconds).
        timeout: Total seconds one open or read may spend failing and backing off.
        block_size: Bytes per read request for remote shards (``None``: the filesystem's).
        max_member_bytes: The largest tar member read, in bytes (default 256 MiB; ``None``: no
            limit): a larger one (a hostile shard, a gzip bomb) fails its shard with a
            ``ShardError`` of kind ``too_large`` naming the shard and the member, before any of
            it is read, and goes to ``handler`` like any other bad shard.
        max_sample_bytes: The most one sample's members may hold together, in bytes, each
            counted with its 512-byte header (default 1 GiB; ``None``: no limit).

    ``urls`` is a brace pattern (``s3://bucket/train-{000000..000099}.tar``), a list of URLs,
    or any webdataset shard-list specification; local paths, ``file://`` URLs and webdataset's
    ``pipe:COMMAND`` URLs (the command's standard output is the shard; see ``PipeStream``) work too.
    """

    def __init__(
        self,
        urls: Any,
        handler: Callable[[BaseException], bool] = reraise_exception,
        mode: str | None = None,
        resampled: bool = False,
        repeat: bool = False,
        shardshuffle: int | bool | None = None,
        cache_size: int = -1,
        cache_dir: str | None = None,
        url_to_name: Any = None,
        detshuffle: bool = False,
        nodesplitter: Callable[..., Any] | None = shardlists.single_node_only,
        workersplitter: Callable[..., Any] | None = shardlists.split_by_worker,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        empty_check: bool = True,
        verbose: bool = False,
        seed: int | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_member_bytes: int | None = MAX_MEMBER_BYTES,
        max_sample_bytes: int | None = MAX_SAMPLE_BYTES,
        **opener: Unpack[OpenerOptions],
    ) -> None:
        if cache_dir is not None:
            raise ConfigError(
                "cache_dir is not supported when shards are read through fsspec; cache with fsspec "
                "instead: urls=['filecache::s3://bucket/train-000000.tar', ...] (a list: in a string "
                "webdataset reads '::' as a separator), storage_options={'s3': {...}, 'filecache': "
                "{'cache_storage': '/local/cache'}}"
            )
        spec = isinstance(urls, dict) or (
            isinstance(urls, str) and (urls.endswith((".yaml", ".yml")) or urlparse(urls).path.endswith("/"))
        )
        self.urls: list[str] | None = None if spec else expand_urls(urls)
        # webdataset builds the pipeline: the shard list, node and worker splitting, shard
        # shuffling, the seed (WDS_SEED), its warnings. What is ours is how a shard is opened and
        # read, swapped in below.
        # (super(), not wds.WebDataset: code that sets wds.WebDataset = siftpipe's class, to
        # retrofit it, recursed here for ever)
        super().__init__(
            urls if self.urls is None else self.urls,
            handler=handler,
            mode=mode,
            resampled=resampled,
            shardshuffle=shardshuffle,
            cache_size=0,
            detshuffle=detshuffle,
            nodesplitter=nodesplitter,
            workersplitter=workersplitter,
            select_files=select_files,
            rename_files=rename_files,
            empty_check=empty_check,
            verbose=verbose,
            seed=seed,
        )
        self.verbose = verbose
        self.opener = shard_opener(storage_options, opener, "WebDataset")
        self.reader = ShardReader(
            self.opener,
            handler,
            select_files=select_files,
            rename_files=rename_files,
            max_member_bytes=max_member_bytes,
            max_sample_bytes=max_sample_bytes,
        )
        self._read_shards_with(self.reader)
        if repeat:
            # webdataset 1.0.2 takes repeat and ignores it: its users' epoch loops end, and so do
            # they here (repeating made such a loop never end)
            warnings.warn(
                "WebDataset(repeat=True) is ignored, as webdataset 1.0.2 ignores it: each pass "
                "reads the shards once; for an endless stream call .repeat() (or .with_epoch(n) "
                "for epochs of n samples)",
                UserWarning,
                stacklevel=2,
            )

    def _read_shards_with(self, reader: ShardReader) -> None:
        """Put ``reader`` where webdataset's pipeline opens shards, expands tar files and groups
        members into samples (three stages in webdataset 1.0.2); a pipeline of another shape is
        refused rather than read wrongly."""
        stages = self.pipeline
        openers = (wds_cache.StreamingOpen, wds_cache.FileCache)
        at = next((i for i, stage in enumerate(stages) if isinstance(stage, openers)), -1)
        found = [getattr(stage, "f", None) for stage in stages[at + 1 : at + 3]] if at >= 0 else []
        if found != [tariterators.tar_file_expander, tariterators.group_by_keys]:
            raise ConfigError(
                f"webdataset {getattr(wds, '__version__', '?')} builds a WebDataset pipeline siftpipe does "
                "not know (it replaces webdataset's shard opener, tar_file_expander and group_by_keys "
                "stages); install the webdataset version siftpipe is tested with (1.0.2)"
            )
        stages[at : at + 3] = [reader]

    def _sample_handler(self, handler: Callable[[BaseException], bool] | None) -> _SampleHandler:
        # webdataset's own default for a sample step, whatever the dataset's handler (until
        # 2026-12-05 the dataset's: a webdataset user's handler=warn_and_continue, meant for
        # shards, then skipped every sample that failed to decode, where webdataset raises)
        return _SampleHandler(handler or reraise_exception, [self.opener.counts])

    def decode(
        self,
        *args: Any,
        pre: Any = None,
        post: Any = None,
        only: Any = None,
        partial: bool = False,
        handler: Callable[[BaseException], bool] | None = None,
    ) -> Any:
        """webdataset's ``.decode()``. A field that cannot be decoded raises ``SampleError`` naming
        the shard, the sample and the field, or goes to ``handler`` (default, as in webdataset:
        re-raise, whatever the dataset's ``handler``): ``warn_and_continue`` skips the sample with
        a ``ShardWarning``, counted in ``shard_stats().samples_skipped``."""
        handlers = [autodecode.ImageHandler(x) if isinstance(x, str) else x for x in args]
        decoder = autodecode.Decoder(handlers, pre=pre, post=post, only=only, partial=partial)
        return self.compose(filters.map(_Decode(decoder), handler=self._sample_handler(handler)))

    def to_tuple(
        self,
        *args: Any,
        handler: Callable[[BaseException], bool] | None = None,
        missing_is_error: bool = True,
        none_is_error: bool | None = None,
    ) -> Any:
        """webdataset's ``.to_tuple()``. A sample missing a field raises ``SampleError`` naming the
        shard, the sample, the field and the fields it has, or goes to ``handler`` (default, as in
        webdataset: re-raise), counted in ``shard_stats().samples_skipped`` when skipped."""
        step = _ToTuple(args, missing_is_error, none_is_error)
        return self.compose(filters.map(step, handler=self._sample_handler(handler)))

    def __repr__(self) -> str:
        if self.urls:
            where = f"{len(self.urls)} shard(s): {redact_url(self.opener.redact(self.urls[0]))}"
            where += ", ..." if len(self.urls) > 1 else ""
        else:
            where = "shard list spec"
        options = redact_options(self.opener.storage_options)
        return f"{type(self).__name__}({where}; storage_options={options}, {len(self.pipeline)} stages)"


def _contains_sift(dataset: Any) -> bool:
    pipeline = getattr(dataset, "pipeline", None)
    if not isinstance(pipeline, list):
        return False
    return any(isinstance(stage, SiftStage | Sifter) or _contains_sift(stage) for stage in pipeline)


class WebLoader(SiftFluid, wds.WebLoader):
    """webdataset's ``WebLoader`` (a DataLoader with a fluid interface), with ``.sift()``.

    ``WebLoader(dataset, batch_size=None, num_workers=N)`` hands the batches the workers made
    to the training process, where ``.sift(...)`` scores them with the live model. It refuses
    (``SiftInWorkerError``) a dataset that already holds a sift stage when ``num_workers > 0``:
    the stage would run in the workers, on stale copies of the model.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        dataset = args[0] if args else kwargs.get("dataset")
        workers = kwargs.get("num_workers", args[5] if len(args) > 5 else 0)
        if workers and _contains_sift(dataset):
            raise SiftInWorkerError(
                f"the dataset given to WebLoader(num_workers={workers}) holds a sift stage, which "
                "would run inside the DataLoader workers, where the model is a copy made when each "
                "worker started: its scores would come from stale weights. Decode and batch in the "
                "workers, and sift in the training process after the loader: "
                "WebLoader(dataset, batch_size=None, num_workers=...).sift(sifter)"
            )
        super().__init__(*args, **kwargs)
