"""Exception classes: every error siftpipe raises on purpose is a ``SiftError``."""

from __future__ import annotations

import tarfile
from collections.abc import Sequence
from typing import Any, ClassVar

from webdataset.autodecode import DecodingError

__all__ = [
    "AuditError",
    "BatchError",
    "ConfigError",
    "CorruptShardError",
    "DuplicateFieldError",
    "MissingExtraError",
    "MissingFieldError",
    "MissingKeyError",
    "NonFiniteLossError",
    "PolicyError",
    "PreDecodeWarning",
    "RegistryError",
    "RepeatedKeyWarning",
    "ResumeError",
    "SampleDecodeError",
    "SampleError",
    "ScoreMemoryWarning",
    "ScorerError",
    "ScorerOutputError",
    "ShardCommandError",
    "ShardError",
    "ShardNotFoundError",
    "ShardPermissionError",
    "ShardUnavailableError",
    "SiftError",
    "ShardWarning",
    "SiftInWorkerError",
    "PassClosedError",
]


class SiftError(Exception):
    """Base class of siftpipe's errors; catch this to catch them all."""


class ConfigError(SiftError, ValueError):
    """A parameter is out of its range (``micro_batch < 1``, ``beta <= 0``, ...)."""


class RegistryError(SiftError, LookupError):
    """An unknown scorer or policy name, or a name registered twice."""


class ScorerError(SiftError):
    """The scorer raised; the message names the micro-batch and its sample keys."""


class ScorerOutputError(SiftError):
    """The scorer returned something other than one finite-typed loss per sample."""


class NonFiniteLossError(SiftError):
    """A loss was NaN or infinite and ``on_nan="raise"``."""


class BatchError(SiftError, ValueError):
    """A collated batch whose fields disagree on how many samples it holds."""


class MissingKeyError(SiftError):
    """A sample lacks the key field that the audit log, replay or score memory needs."""


class MissingExtraError(SiftError, ImportError):
    """An optional dependency is not installed (a plot needs matplotlib, an integration its
    trainer); the message names the ``pip install "siftpipe[...]"`` that brings it."""

    @classmethod
    def of(cls, module: str, extra: str, packages: str, cause: ImportError) -> MissingExtraError:
        """The error for ``module``, which needs ``packages`` from ``siftpipe[extra]``."""
        missing = cause.name or str(cause)
        return cls(
            f'{module} needs {packages} ({missing} is not importable): pip install "siftpipe[{extra}]"'
        )


class PolicyError(SiftError):
    """A policy's ``decide`` returned a malformed ``Decision`` (wrong length, type or dtype, a keep
    probability outside [0, 1], a NaN, negative or infinite weight), or raised (the exception is
    the cause); the message names the policy, the micro-batch and what was wrong."""


class ResumeError(SiftError):
    """A state dict does not fit this stage, or the source was not fed from ``consumed``."""


class PassClosedError(SiftError, RuntimeError):
    """An iterator of a pass was read after the stage closed that pass: ``sifter(...)`` was called
    again (each call opens a new pass and closes the one before), a checkpoint was loaded, or
    ``close()`` was called. The message says which."""


class SiftInWorkerError(SiftError):
    """The stage runs inside a DataLoader worker, where the model is a stale copy, or its pass is
    read in a thread other than the training thread that opened it (a prefetching thread), where
    it would use the model and the score memory while the training step does."""


class AuditError(SiftError):
    """The audit log could not be written or read."""


class ShardError(SiftError):
    """A shard could not be opened or read (after retries).

    Attributes (``None`` when not known): ``url`` (the shard, credentials redacted), ``key`` (the
    last sample key read from it), ``kind`` (``"missing"``, ``"missing_bucket"``, ``"denied"``,
    ``"no_credentials"``, ``"transient"``, ``"corrupt"``, ``"too_large"``, ``"command"`` or
    ``"other"``).

    Each error is also an instance of what webdataset raises for the same fault, so that code
    written for webdataset catches it unchanged: ``ShardError(message, kind=...)`` returns the
    subclass for its kind, as ``OSError(errno.ENOENT, ...)`` returns a ``FileNotFoundError``:

    ========================================  =====================================================
    kind                                      class (and the built-in it also is)
    ========================================  =====================================================
    ``missing``, ``missing_bucket``           ``ShardNotFoundError`` (``FileNotFoundError``)
    ``denied``, ``no_credentials``            ``ShardPermissionError`` (``PermissionError``)
    ``transient``                             ``ShardUnavailableError`` (``OSError``)
    ``command`` (a ``pipe:`` command failed)  ``ShardCommandError`` (``OSError``)
    ``corrupt``                               ``CorruptShardError`` (``tarfile.ReadError``;
                                              ``DuplicateFieldError`` also ``ValueError``)
    ``too_large``, ``other``                  ``ShardError`` only
    ========================================  =====================================================
    """

    #: The kind of an instance made without one. A DataLoader worker's error reaches the training
    #: process rebuilt from its class and message only (torch's rule); the class keeps the kind.
    default_kind: str | None = None
    #: kind -> subclass, for ``ShardError(..., kind=...)`` (filled in below the subclasses).
    _by_kind: ClassVar[dict[str, type[ShardError]]] = {}

    def __new__(cls, message: str = "", *args: object, **kwargs: object) -> ShardError:
        table = cls.__dict__.get("_by_kind")
        kind = kwargs.get("kind")
        target: type[ShardError] = table[kind] if table and isinstance(kind, str) and kind in table else cls
        # the target's own MRO: an OSError subclass must be made by OSError.__new__
        return super(ShardError, target).__new__(target, message)

    def __init__(
        self, message: str, *, url: str | None = None, key: str | None = None, kind: str | None = None
    ) -> None:
        # BaseException's own __init__, not the built-in mixin's: webdataset's DecodingError
        # would take the message for its url
        BaseException.__init__(self, message)
        self.url = url
        self.key = key
        self.kind = kind if kind is not None else self.default_kind

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # keep the class and the attributes across processes (DataLoader workers pickle errors)
        attributes = {"url": self.url, "key": self.key, "kind": self.kind}
        return (_rebuild_error, (type(self), str(self), attributes))


def _rebuild_error(cls: type[ShardError], message: str, attributes: dict[str, str | None]) -> ShardError:
    return cls(message, **attributes)


class ShardNotFoundError(ShardError, FileNotFoundError):
    """The shard, or its bucket, does not exist (kinds ``missing``, ``missing_bucket``)."""

    default_kind = "missing"


class ShardPermissionError(ShardError, PermissionError):
    """Access to the shard was denied, or no credentials were found (``denied``, ``no_credentials``)."""

    default_kind = "denied"


class ShardUnavailableError(ShardError, OSError):
    """The storage did not answer within the retries and the timeout (``transient``)."""

    default_kind = "transient"


class ShardCommandError(ShardError, OSError):
    """The command of a ``pipe:`` URL failed (``command``): it could not start, or it exited with
    a non-zero status (webdataset raises ``OSError`` for this too)."""

    default_kind = "command"


class CorruptShardError(ShardError, tarfile.ReadError):
    """The shard is not a readable tar archive: truncated, a corrupt header, a broken gzip stream,
    or a member that no tar writer makes (``corrupt``)."""

    default_kind = "corrupt"


class DuplicateFieldError(CorruptShardError, ValueError):
    """A sample of the shard has two members for one field (``a.cls`` twice): ``corrupt``, and
    also the ``ValueError`` webdataset raises for it ("duplicate file name in tar file")."""

    default_kind = "corrupt"


ShardError._by_kind = {
    "missing": ShardNotFoundError,
    "missing_bucket": ShardNotFoundError,
    "denied": ShardPermissionError,
    "no_credentials": ShardPermissionError,
    "transient": ShardUnavailableError,
    "command": ShardCommandError,
    "corrupt": CorruptShardError,
}


class SampleError(ShardError):
    """One sample of a shard could not be decoded, or lacks a field the pipeline asked for.

    Attributes as ``ShardError`` (``kind`` is ``"corrupt"`` for a field that cannot be decoded,
    ``"missing_field"`` for a missing one), plus ``field``: the field, when known.
    ``SampleError(message, kind=...)`` returns ``SampleDecodeError`` (also webdataset's
    ``DecodingError``, with its ``k`` attribute) for ``corrupt`` and ``MissingFieldError`` (also
    ``ValueError``, as webdataset's ``to_tuple`` raises) for ``missing_field``.
    """

    _by_kind: ClassVar[dict[str, type[ShardError]]] = {}

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        key: str | None = None,
        kind: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message, url=url, key=key, kind=kind)
        self.field = field

    def __reduce__(self):  # type: ignore[no-untyped-def]
        attributes = {"url": self.url, "key": self.key, "kind": self.kind, "field": self.field}
        return (_rebuild_error, (type(self), str(self), attributes))


class SampleDecodeError(SampleError, DecodingError):
    """A field of a sample cannot be decoded (``corrupt``); also webdataset's ``DecodingError``."""

    default_kind = "corrupt"
    #: webdataset's DecodingError attribute: the sample that failed (set where a ``.decode()``
    #: raises it; ``None`` after the error crossed processes, as a DataLoader worker's does)
    sample: Any = None

    @property
    def k(self) -> str | None:
        """webdataset's name for ``field``."""
        return self.field


class MissingFieldError(SampleError, ValueError):
    """A sample lacks a field that ``.to_tuple()`` asked for (``missing_field``); also ``ValueError``."""

    default_kind = "missing_field"


SampleError._by_kind = {"corrupt": SampleDecodeError, "missing_field": MissingFieldError}


class ShardWarning(UserWarning):
    """A shard or a sample was skipped (``handler=warn_and_continue``); the message names it and why."""


class EmptyPassWarning(UserWarning):
    """A pass read nothing from its source though earlier passes read samples: most likely a spent
    iterator given again (a generator, an iterator, a torchdata node without ``Loader`` or
    ``reset``), which yields nothing and so trains nothing that epoch."""


class BatchShapeWarning(UserWarning):
    """A batch's shape costs or may mean something it should not: a pass ends with a short
    output batch whose size changes every epoch while ``torch.backends.cudnn.benchmark`` is on
    (each new size is autotuned again: pass ``Sifter(..., drop_last=True)`` to hand on only full
    batches), or a batched field is a list of as many tensors (or lists) as the batch has rows,
    each holding that many rows: read as ``default_collate``'s columns (a tuple field), it would be
    cut wrongly if it held one value per sample (stack those, or hold them in a numpy object
    array)."""


class PreDecodeWarning(UserWarning):
    """A ``PreDecodeFilter`` finds no publication: every sample goes on to the stage undecided."""


class ScoreMemoryWarning(UserWarning):
    """A pass finds none of its samples in a score memory that holds keys from earlier passes: the
    keys the memory was fed (``observe``) do not match the batch's, or samples never repeat."""


class RepeatedKeyWarning(ScoreMemoryWarning):
    """Training losses handed back in one pass replaced others the same key got earlier in it: two
    samples share a key (the memory then decides both by one loss), one sample was trained twice
    (a stream sampling with replacement), or two passes had one epoch number."""


def describe_keys(keys: Sequence[object] | None, limit: int = 4) -> str:
    """A short, readable list of sample keys for error messages."""
    if not keys:
        return "(no sample keys: samples carry no key field)"
    shown = ", ".join(repr(k) for k in list(keys)[:limit])
    more = len(keys) - limit
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"
