"""Exception classes: every error siftpipe raises on purpose is a ``SiftError``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AuditError",
    "ConfigError",
    "MissingKeyError",
    "NonFiniteLossError",
    "PolicyError",
    "RegistryError",
    "ResumeError",
    "SampleError",
    "ScorerError",
    "ScorerOutputError",
    "ShardError",
    "SiftError",
    "ShardWarning",
    "SiftInWorkerError",
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


class MissingKeyError(SiftError):
    """A sample lacks the key field that the audit log, replay or score memory needs."""


class PolicyError(SiftError):
    """A policy's ``decide`` returned a malformed ``Decision`` (wrong length, type or dtype, a keep
    probability outside [0, 1], a NaN, negative or infinite weight); the message names the policy,
    the micro-batch and what was wrong."""


class ResumeError(SiftError):
    """A state dict does not fit this stage, or the source was not fed from ``consumed``."""


class SiftInWorkerError(SiftError):
    """The stage runs inside a DataLoader worker, where the model is a stale copy."""


class AuditError(SiftError):
    """The audit log could not be written or read."""


class ShardError(SiftError):
    """A shard could not be opened or read (after retries).

    Attributes (``None`` when not known): ``url`` (the shard, credentials redacted), ``key`` (the
    last sample key read from it), ``kind`` (``"missing"``, ``"missing_bucket"``, ``"denied"``,
    ``"no_credentials"``, ``"transient"``, ``"corrupt"`` or ``"other"``).
    """

    def __init__(
        self, message: str, *, url: str | None = None, key: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.url = url
        self.key = key
        self.kind = kind

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # keep the attributes across processes (DataLoader workers pickle their errors)
        return (_rebuild_shard_error, (str(self), self.url, self.key, self.kind))


def _rebuild_shard_error(message: str, url: str | None, key: str | None, kind: str | None) -> ShardError:
    return ShardError(message, url=url, key=key, kind=kind)


class SampleError(ShardError):
    """One sample of a shard could not be decoded, or lacks a field the pipeline asked for.

    Attributes as ``ShardError`` (``kind`` is ``"corrupt"`` for a field that cannot be decoded,
    ``"missing_field"`` for a missing one), plus ``field``: the field, when known.
    """

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
        return (_rebuild_sample_error, (str(self), self.url, self.key, self.kind, self.field))


def _rebuild_sample_error(
    message: str, url: str | None, key: str | None, kind: str | None, field: str | None
) -> SampleError:
    return SampleError(message, url=url, key=key, kind=kind, field=field)


class ShardWarning(UserWarning):
    """A shard or a sample was skipped (``handler=warn_and_continue``); the message names it and why."""


def describe_keys(keys: Sequence[object] | None, limit: int = 4) -> str:
    """A short, readable list of sample keys for error messages."""
    if not keys:
        return "(no sample keys: samples carry no key field)"
    shown = ", ".join(repr(k) for k in list(keys)[:limit])
    more = len(keys) - limit
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"
