"""Open shards at any fsspec URL (S3, GCS, HTTP, local) and read tar shards into samples.

The pieces, in the order data flows:

* ``ShardOpener`` opens one URL through fsspec with explicit storage options (or the standard
  environment). Filesystems are created lazily, once per process and protocol, never shared
  across ``fork`` (an s3fs instance made in the parent is unusable in a DataLoader worker).
  Transient failures (connection errors, timeouts, 5xx and throttling answers, truncated reads)
  are retried with exponential backoff, both while opening and while reading: a read that fails
  mid-stream reopens the object and continues at the same byte offset.
* ``iter_tar_samples`` groups the members of one tar stream into WebDataset samples and reports,
  after each sample, the byte offset where the next one starts (for exact, seek-based resume).
* ``ShardReader`` is a pipeline stage: shard URLs in, samples out, with a webdataset-style
  ``handler`` deciding whether a shard that cannot be read stops the pipeline or is skipped.

Every error is a ``ShardError`` that names the shard URL (and the last sample key when known) and
the likely fix; no message, warning, log record or repr ever contains a credential.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import random
import re
import select
import signal
import subprocess
import tarfile
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypedDict
from urllib.parse import urlsplit

from .._secrets import (
    Redactor,
    command_secrets,
    redact,
    redact_command,
    redact_options,
    redact_url,
    refuse_credentials_in_endpoint,
    refuse_credentials_in_url,
    secret_values,
    url_secrets,
)
from ..core.files import answer_of, may_pass
from ..core.shardcounts import (
    ShardStats,
    SharedShardCounts,
    count_here,
    find_shard_counts,
    merge_shard_stats,
    reset_shard_stats,
    shard_stats,
)
from ..errors import ConfigError, DuplicateFieldError, ShardError, ShardWarning

__all__ = [
    "OpenerOptions",
    "ShardOpener",
    "ShardReader",
    "MAX_EXTENDED_HEADER_BYTES",
    "MAX_MEMBER_BYTES",
    "MAX_SAMPLE_BYTES",
    "ShardStats",
    "SharedShardCounts",
    "TarLimitError",
    "classify_error",
    "describe_error",
    "find_shard_counts",
    "ignore_and_continue",
    "merge_shard_stats",
    "ignore_and_stop",
    "iter_tar_samples",
    "local_path",
    "PipeStream",
    "redact_url",
    "reraise_exception",
    "reset_shard_stats",
    "shard_stats",
    "warn_and_continue",
    "warn_and_stop",
]

log = logging.getLogger("siftpipe.shards")
#: The retries' jitter: a generator of its own, so that a retry in the training process does not
#: move Python's global random state, which the training loop's own draws use (found by review,
#: 2026-12-06)
_JITTER = random.Random()
# (and one of its own in each forked process: DataLoader workers retrying at once spread apart,
# as the global generator, reseeded in each child, made them; the review of that change)
os.register_at_fork(after_in_child=_JITTER.seed)

Handler = Callable[[BaseException], bool]

PIPE = "pipe:"


# ---------------------------------------------------------------------------------- handlers


def reraise_exception(exn: BaseException) -> bool:
    """Handler: raise the error (the default): a shard that cannot be read stops the pipeline."""
    raise exn


def describe_error(exn: BaseException) -> str:
    """What a handler shows for ``exn``: a siftpipe error's message, or for any other error (one
    that webdataset raised, say) its type and message, with the shard, sample and field it
    carries, and its cause. Never empty (webdataset's ``DecodingError`` has no message)."""
    if isinstance(exn, ShardError):
        return str(exn)
    text = f"{type(exn).__name__}: {exn}" if str(exn) else type(exn).__name__
    where = [
        f"{label} {redact_url(value) if label == 'shard' else value!r}"
        for attr, label in (("url", "shard"), ("key", "sample"), ("k", "field"))
        if isinstance(value := getattr(exn, attr, None), str)
    ]
    if where:
        text += f" ({', '.join(where)})"
    cause = exn.__cause__
    if cause is not None:
        text += f": {type(cause).__name__}: {cause}"
    return redact(text, secret_values())


def warn_and_continue(exn: BaseException) -> bool:
    """Handler: warn (``ShardWarning``, naming the shard and why) and skip to the next shard."""
    warnings.warn(describe_error(exn), ShardWarning, stacklevel=2)
    return True


def ignore_and_continue(exn: BaseException) -> bool:
    """Handler: skip the shard silently (it is still counted in ``shard_stats().skipped``)."""
    return True


def warn_and_stop(exn: BaseException) -> bool:
    """Handler: warn and end the pass quietly at this shard."""
    warnings.warn(describe_error(exn), ShardWarning, stacklevel=2)
    return False


def ignore_and_stop(exn: BaseException) -> bool:
    """Handler: end the pass quietly at this shard."""
    return False


# ---------------------------------------------------------------------------------- classifying

_TRANSIENT_ERRNO = {
    errno.EIO,
    errno.EBUSY,
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
    getattr(errno, "EREMOTEIO", errno.EIO),
}
_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
}
_DENIED_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "AccountProblem",
}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


_NO_BUCKET = re.compile(
    r"(?i)no\s*such\s*bucket|bucket\s+(?:does\s+not|doesn't)\s+exist|bucket\s+(?:\S+\s+)?not\s+found"
)


def classify_error(exc: BaseException) -> str:
    """What went wrong, from an error raised by fsspec (or its backend) or by tarfile.

    Returns one of ``"missing_bucket"``, ``"missing"``, ``"denied"``, ``"no_credentials"``,
    ``"transient"`` (worth retrying), ``"corrupt"``, ``"too_large"`` (``TarLimitError``) or
    ``"other"``.
    """
    if isinstance(exc, ShardError) and exc.kind:
        return exc.kind
    chain = list(_chain(exc))
    for e in chain:
        name = type(e).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError", "ProfileNotFound", "NoAuthTokenError"):
            return "no_credentials"
        code, status = answer_of(e)
        if code == "NoSuchBucket":
            return "missing_bucket"
        if code in ("NoSuchKey", "404") or status == 404:
            return "missing"
        if code in _DENIED_CODES or status in (401, 403):
            return "denied"
        if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return "transient"
    first = chain[0]
    if isinstance(first, TarLimitError):
        return "too_large"
    if isinstance(first, FileNotFoundError):
        if any(may_pass(e) for e in chain[1:]):
            # fsspec's HTTP filesystem says FileNotFoundError for any failure to learn a file's
            # size, a refused connection included (found by review, 2026-12-05: an outage of 3 s
            # gave https shards up as "no such object", unretried); a 404 was answered above
            return "transient"
        # what the store says ("The specified bucket does not exist"), not the word in a path
        # (s3://team-bucket-data/x.tar was told its bucket did not exist; found by review, 2026-12-05)
        return "missing_bucket" if _NO_BUCKET.search(str(first)) else "missing"
    if isinstance(first, PermissionError):
        return "denied"
    if any(may_pass(e) for e in chain):
        return "transient"
    if isinstance(first, tarfile.TarError | EOFError) or type(first).__name__ in ("BadGzipFile", "error"):
        return "corrupt"
    if isinstance(first, OSError) and first.errno in _TRANSIENT_ERRNO:
        return "transient"
    return "other"


_FIX = {
    "missing_bucket": "the bucket {bucket} does not exist at this endpoint: check the bucket name in the URL "
    "and storage_options['endpoint_url'] (or AWS_ENDPOINT_URL)",
    "missing": "there is no such object: check the shard pattern (prefix, brace range such as "
    "{{000000..000009}}, extension) against the shards that were written",
    "denied": "access was denied: check the credentials (storage_options key/secret/token or profile, "
    "or the AWS_* environment variables), the bucket policy, or pass anon=True for a public bucket",
    "no_credentials": "no usable credentials were found: check that the profile (storage_options "
    "['profile'] or AWS_PROFILE) exists in the AWS config files, or set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, pass storage_options key/secret, or anon=True for a public bucket",
    "transient": "the storage did not answer: check the endpoint and the network, raise retries= or "
    "timeout=, or pass handler=warn_and_continue to skip shards that cannot be read",
    "corrupt": "it is not a readable tar archive (truncated or corrupt): rewrite the shard, or pass "
    "handler=warn_and_continue to skip it",
    "too_large": "the reader takes one sample into memory at a time and refuses more: raise "
    "max_member_bytes= or max_sample_bytes= (WebDataset, ShardSource; None: no limit) if the shard is "
    "trusted and such members are expected, or pass handler=warn_and_continue to skip it",
    "other": "pass handler=warn_and_continue to skip shards that cannot be read",
}


# ---------------------------------------------------------------------------------- opening


class OpenerOptions(TypedDict, total=False):
    """The ``ShardOpener`` settings that ``WebDataset`` and ``ShardSource`` take as keyword
    arguments and hand on (their meaning, units and defaults: ``ShardOpener``)."""

    retries: int
    backoff: float
    max_backoff: float
    timeout: float | None
    block_size: int | None


def shard_opener(
    storage_options: Mapping[str, Any] | None, options: Mapping[str, Any], caller: str
) -> ShardOpener:
    """A ``ShardOpener`` from a constructor's ``storage_options`` and ``**options``; a name that is
    not an ``OpenerOptions`` key is a ``TypeError`` naming ``caller``, as Python's own would."""
    for name in options:
        if name not in OpenerOptions.__annotations__:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    return ShardOpener(storage_options, **options)


class ShardOpener:
    """Opens shard URLs through fsspec, lazily in each process, retrying transient failures.

    Args:
        storage_options: fsspec options for the URL's filesystem, e.g. ``{"endpoint_url": ...,
            "key": ..., "secret": ...}``, ``{"profile": "research"}`` or ``{"anon": True}`` for S3.
            ``None``: the filesystem's defaults (for S3 the standard AWS environment and config).
        retries: Retries of one failed open or read (transient errors only) before giving up.
        backoff: Seconds to wait before the first retry; doubled after each (with jitter).
        max_backoff: Longest wait between two attempts, in seconds.
        timeout: Total seconds one open or read may spend, from its first attempt, failing and
            backing off before the shard is given up (``None``: only ``retries`` limits it): no
            retry starts that would wait past it (an upload by ``write_shards`` counts from its
            first failure, so a long upload that fails once is still retried). A request in
            flight is not cut short: per-request timeouts are the filesystem's own (for S3:
            ``config_kwargs={"connect_timeout": s, "read_timeout": s}``), so one open can take
            up to one of those beyond ``timeout``.
        block_size: Bytes fetched per request when reading a remote object (``None``: the
            filesystem's default, 5 MiB for S3). Smaller blocks lose less on a dropped connection.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        timeout: float | None = 120.0,
        block_size: int | None = None,
    ) -> None:
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError(
                f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}"
            )
        for name, value in (storage_options or {}).items():
            if isinstance(name, str) and name.endswith("_kwargs") and not isinstance(value, Mapping):
                # (s3fs's client_kwargs, config_kwargs, s3_additional_kwargs): given as text, the
                # client failed at each shard's first request with an AttributeError that read as
                # a bad shard, and a handler skipped every shard
                raise ConfigError(
                    f"storage_options[{name!r}] must be a dict of options, got {type(value).__name__}: "
                    f"pass it as a dict (on the command line, as dotted keys: --storage-option "
                    f"{name}.<option>=<value>)"
                )
        if not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries must be a number of retries >= 0, got {retries!r}")
        if backoff < 0 or max_backoff < 0:
            raise ConfigError(
                f"backoff and max_backoff must be seconds >= 0, got {backoff!r}, {max_backoff!r}"
            )
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"timeout must be seconds > 0 or None, got {timeout!r}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ConfigError(f"block_size must be a number of bytes >= 1 or None, got {block_size!r}")
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        self.retries = retries
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.timeout = timeout
        self.block_size = block_size
        self.redact = Redactor(self.storage_options)
        self._filesystems: dict[tuple[int, str], Any] = {}
        #: Counters of everything read through this opener, in every process (see ``stats``).
        self.counts = SharedShardCounts()

    def count(self, name: str, n: int = 1) -> None:
        """Count an event in this process's ``shard_stats()`` and in this opener's shared counters."""
        count_here(name, n)
        self.counts.add(name, n)

    def stats(self) -> ShardStats:
        """What was read through this opener, summed over every process (DataLoader workers too)."""
        return self.counts.stats()

    # the filesystems are per process: never pickle them into a worker
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_filesystems"] = {}
        return state

    def __repr__(self) -> str:
        return (
            f"ShardOpener(storage_options={redact_options(self.storage_options)!r}, retries={self.retries}, "
            f"backoff={self.backoff}, timeout={self.timeout}, block_size={self.block_size})"
        )

    def filesystem(self, url: str) -> tuple[Any, str]:
        """(fsspec filesystem, path) for ``url``; the filesystem is made once per process."""
        import fsspec
        from fsspec.core import split_protocol

        # s3://KEY:SECRET@bucket: refused before any request (the store's error quoted a piece of
        # the secret as a bucket name; found by review, 2026-12-06), as the audit log refuses it
        refuse_credentials_in_url(url, ConfigError)
        refuse_credentials_in_endpoint(url, self.storage_options, ConfigError)
        protocol, _ = split_protocol(url)
        protocol = protocol or "file"
        if "::" in url:  # chained URLs (simplecache::s3://...) carry per-layer options
            fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **self.storage_options)
            return fs, path
        slot = (os.getpid(), protocol)
        fs = self._filesystems.get(slot)
        if fs is None:
            if protocol not in fsspec.available_protocols():
                raise ConfigError(
                    f"no fsspec filesystem for {protocol}:// URLs (in {self.redact(redact_url(url))}): "
                    "check the URL's scheme (s3://, gs://, az://, https://, file://)"
                )
            try:
                fs = fsspec.filesystem(protocol, skip_instance_cache=True, **self.storage_options)
            except ImportError as exc:
                raise ConfigError(
                    f"no fsspec filesystem for {protocol}:// URLs ({self.redact(str(exc))}); install the "
                    f"package that provides it (s3fs for s3://, gcsfs for gs://, adlfs for az://)"
                ) from None
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"the storage options were rejected by the {protocol}:// filesystem: "
                    f"{type(exc).__name__}: {self.redact(str(exc))}; storage options were "
                    f"{redact_options(self.storage_options)}"
                ) from None
            self._filesystems[slot] = fs
        return fs, fs._strip_protocol(url)

    def open(self, url: str, offset: int = 0, *, count: bool = True) -> RetryingFile:
        """A read-only binary stream of ``url`` from byte ``offset``, retried as configured.

        ``count=False`` leaves the ``opened`` counter alone (a peek at a few bytes, not a read of
        the shard: the counters then match the uninterrupted pass's). Raises ``ShardError``
        (naming the URL and the likely fix) when it cannot be opened."""
        stream = RetryingFile(self, url, offset)
        stream.connect(count)
        return stream

    def _raw_open(self, url: str, offset: int) -> Any:
        url = gopen_rewrite(url)  # the bytes come from there; errors, keys and logs name ``url``
        if url.startswith(PIPE):
            f: Any = PipeStream(url[len(PIPE) :], self.redact(redact_url(url)), self.timeout)
            if offset:
                _skip_bytes(f, offset)
            return f
        fs, path = self.filesystem(url)
        kwargs: dict[str, Any] = {}
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        if self.block_size is not None and "file" not in protocols:
            kwargs["block_size"] = self.block_size
        try:
            f = fs.open(path, "rb", **kwargs)
        except TypeError as exc:
            # a client setting the backend takes only when it first connects (s3fs builds its
            # client at the first request: client_kwargs={"region": ...} or a misspelt
            # config_kwargs key fail here, not when the filesystem is made): a setting, not a bad
            # shard, so never skipped by a handler nor retried
            raise ConfigError(
                f"the storage options were rejected when the {protocols[0]}:// "
                f"filesystem first connected (opening {self.redact(redact_url(url))}): "
                f"{type(exc).__name__}: {self.redact(str(exc))}; storage options were "
                f"{redact_options(self.storage_options)}"
            ) from None
        if offset:
            try:
                f.seek(offset)
            except (OSError, ValueError, io.UnsupportedOperation):
                _skip_bytes(f, offset)
        return f

    def retrying(self, what: str, url: str, fn: Callable[[], Any], key: str | None = None) -> Any:
        """``fn()``, retrying transient failures with exponential backoff; else a ShardError."""
        attempt = 0
        # from the first attempt's start: a request that hangs until the filesystem's own timeout
        # spends the budget too (counted from its failure, a stalled endpoint took twice the
        # timeout and more, and the message understated it). An upload (write_shards) counts from
        # its first failure: a long one that fails once is retried, whatever it took
        started: float | None = None if what == "writing" else time.monotonic()
        while True:
            try:
                return fn()
            except (ShardError, ConfigError):
                raise
            except Exception as exc:  # classified below; never swallowed
                kind = classify_error(exc)
                if started is None:
                    started = time.monotonic()
                spent = time.monotonic() - started
                if kind != "transient" or attempt >= self.retries:
                    err = self.error(exc, url, key, what=what, attempts=attempt + 1, seconds=spent)
                    del exc
                    break
                wait = min(self.max_backoff, self.backoff * 2**attempt) * (0.5 + _JITTER.random() / 2)
                if self.timeout is not None and spent + wait > self.timeout:
                    err = self.error(
                        exc, url, key, what=what, attempts=attempt + 1, seconds=spent, timed_out=True
                    )
                    del exc
                    break
                attempt += 1
                self.count("retries")
                log.info(
                    "retrying %s of shard %s in %.2f s (attempt %d of %d): %s",
                    what,
                    self.redact(redact_url(url)),
                    wait,
                    attempt + 1,
                    self.retries + 1,
                    self.redact(f"{type(exc).__name__}: {exc}"),
                )
                del exc
                time.sleep(wait)
        raise err  # outside the except block: no chained error can carry a credential

    def error(
        self,
        exc: BaseException,
        url: str,
        key: str | None = None,
        *,
        what: str = "reading",
        attempts: int = 1,
        seconds: float = 0.0,
        timed_out: bool = False,
    ) -> ShardError:
        """A ``ShardError`` for ``exc`` that names the shard, the sample and the fix; no secrets."""
        if isinstance(exc, ShardError):
            return exc
        kind = classify_error(exc)
        shown = self.redact(redact_url(url))
        where = ("shards at " if what == "listing" else "shard ") + shown
        where += f" (after sample {key!r})" if key is not None else ""
        # the cause may quote the URL's parts (a bucket "KEY:SECRET@name"): its credentials too
        # and those of the URL a GOPEN_REWRITE rule made of it, which the bytes came from (found
        # by review, 2026-12-05: a rule to s3://KEY:SECRET@bucket/ showed the secret)
        text = f"{type(exc).__name__}: {exc}"
        if kind == "transient" and not may_pass(exc):
            # what the storage did, where a library's own error hides it (s3fs's IndexError
            # "tuple index out of range" around a read timeout; found by review, 2026-12-05)
            causes = [e for e in _chain(exc) if e is not exc and may_pass(e)]
            said = next((e for e in causes if str(e)), causes[0] if causes else None)
            if said is not None:
                text += (
                    f" (caused by {type(said).__name__}: {said})"
                    if str(said)
                    else f" (caused by {type(said).__name__})"
                )
        cause = self.redact(redact(text, url_secrets(url) | rewrite_secrets()))
        tries = ""
        if kind == "transient":
            limit = f"the {self.timeout:g} s timeout" if timed_out else f"{self.retries} retries"
            tries = f" after {attempts} attempt(s) over {seconds:.1f} s ({limit})"
        bucket = urlsplit(url).netloc.rpartition("@")[2] or "(none)"
        fix = _FIX[kind].format(bucket=repr(bucket))
        if what in ("writing", "listing", "removing"):
            # a reader's way out (skip the shard) is no fix for a write (found by review, 2026-12-05)
            head = fix.partition("pass handler=warn_and_continue")[0].rstrip()
            fix = head.removesuffix(" or").rstrip(",; ")
            fix = fix or "check the destination URL, the storage options and the permissions"
        made = DuplicateFieldError if isinstance(exc, _DuplicateMember) else ShardError
        return made(f"{what} {where} failed{tries}: {cause}; {fix}", url=shown, key=key, kind=kind)


def _skip_bytes(f: Any, n: int) -> None:
    while n > 0:
        chunk = f.read(min(n, 1 << 20))
        if not chunk:
            raise EOFError(f"the object ended {n} bytes before the offset to resume at")
        n -= len(chunk)


class _Readable(io.RawIOBase):
    """A read-only raw stream whose subclass gives ``read(n)``; ``readinto`` is built on it."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class PipeStream(_Readable):
    """The standard output of a shell command, read as a shard: webdataset's ``pipe:`` URLs
    (``pipe:aws s3 cp s3://bucket/x.tar -``, ``pipe:curl -s https://host/x.tar``).

    The command runs in its own session (so that closing the stream early ends every process of
    a shell pipeline), with its standard error kept in a temporary file. When its output ends,
    or ``finish()`` is called after the archive's end, a non-zero exit status raises a
    ``ShardError`` (kind ``command``, also an ``OSError`` as webdataset's) naming the command
    (credentials redacted), the status and the end of its standard error. Exit status 141 (a
    shell whose command was ended by SIGPIPE, when the reader stopped reading) counts as success,
    as in webdataset.

    Args:
        command: The shell command (the URL after ``pipe:``).
        shown: The URL to name in errors, credentials already redacted.
        timeout: Seconds ``finish()`` waits for the command to exit after its shard was read
            (``None``: as long as it takes).
    """

    #: Exit statuses that mean success: 0, and a shell's child ended by SIGPIPE (128 + 13).
    OK_STATUS = (0, 128 + signal.SIGPIPE, -signal.SIGPIPE)
    #: Bytes of standard error shown in an error message (the end of it).
    STDERR_SHOWN = 800
    #: Bytes ``finish()`` reads past the archive's end, waiting for the command's output to end
    #: (a tar's record padding is under 10 KiB; gzip's trailer 8 bytes).
    DRAIN_BYTES = 1 << 20
    #: Seconds each read of ``_drain`` waits before it checks whether the command has exited.
    DRAIN_POLL = 0.05
    #: Seconds a command gets to exit once its output is closed, even with ``timeout`` spent:
    #: one still writing dies of SIGPIPE at its next write.
    EXIT_GRACE = 1.0

    def __init__(self, command: str, shown: str, timeout: float | None = None) -> None:
        super().__init__()
        if os.environ.get("WDS_SECURE", "0") not in ("", "0"):
            raise ConfigError(
                f"{shown}: pipe: URLs run shell commands, and WDS_SECURE is set (as in webdataset, "
                "this refuses them); unset WDS_SECURE or read the shards through a storage URL"
            )
        self.command = command
        self.shown = shown
        self.timeout = timeout
        self._pos = 0  # bytes of its output read
        self._zeros = 0  # of them, the zero bytes they end with
        self._head = b""  # its first two bytes (gzip's magic number, or not)
        self._deadline: float | None = None  # reads wait until then at most (``at_most``)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            command,
            shell=True,  # the URL is a shell command by definition (webdataset's pipe:)
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,
        )

    def read(self, n: int | None = -1) -> bytes:
        """``n`` bytes (all of them with ``n < 0``), fewer only at the end of the output or of
        the archive: where what was read so far ends with its end-of-archive marker (two zero
        blocks, at a block boundary), the rest is not waited for. ``read(n)`` waiting for all
        ``n`` bytes made a shard ending inside tarfile's 10 KiB read wait for the command to
        exit, however long it lingered, past ``timeout`` (found by review, 2026-12-05); reads
        shorter than asked anywhere else would mislead the readers that read once (the
        compression check, the resume's peek, the lone-zero-block check)."""
        assert self.proc.stdout is not None
        out: Any = self.proc.stdout  # a BufferedReader: read1 takes what one read of the pipe gives
        if n is None or n < 0:
            data = out.read(-1)
            self._count(data)
        else:
            parts: list[bytes] = []
            got = 0
            while got < n:
                chunk = self._read1(n - got)
                if chunk is None:
                    return b"".join(parts)  # nothing came within the bound (``at_most``)
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
                self._count(chunk)
                if self._zeros >= 2 * tarfile.BLOCKSIZE and self._pos % tarfile.BLOCKSIZE == 0:
                    break  # the end-of-archive marker (or zeros inside a member: read on, asked)
            data = b"".join(parts)
        if not data and n != 0:
            self._ended()  # its output ended: it has `timeout` to exit, as after the archive's end
        return data

    def read_some(self, n: int) -> bytes:
        """What has arrived of the output, up to ``n`` bytes (at least one, unless it ended): for
        a reader that reads on until it has what it needs (a gzip stream's decompressor), which
        must not wait for more than the archive holds."""
        assert self.proc.stdout is not None
        out: Any = self.proc.stdout
        data = self._read1(n) if n > 0 else out.read(n)
        if data is None:
            return b""  # nothing came within the bound (``at_most``)
        self._count(data)
        if not data and n != 0:
            self._ended()
        return data

    def _read1(self, n: int) -> bytes | None:
        """What one read of the pipe gives, up to ``n`` bytes (b"" at its end); ``None`` when a
        bound is set (``at_most``) and nothing came within it."""
        out: Any = self.proc.stdout
        if self._deadline is None:
            return out.read1(n)
        fd = out.fileno()
        os.set_blocking(fd, False)
        try:
            data = out.read1(n)  # what is buffered or has arrived; b"" for none yet, or the end
        finally:
            os.set_blocking(fd, True)
        if data:
            return data
        # poll, not select: select refuses descriptors from 1024 on, which a process with many
        # files open gives (found by review, 2026-12-05)
        waiting = select.poll()
        waiting.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        left_ms = max(0.0, self._deadline - time.monotonic()) * 1000.0
        return out.read1(n) if waiting.poll(left_ms) else None

    @contextlib.contextmanager
    def at_most(self, seconds: float | None) -> Iterator[None]:
        """Reads inside wait at most ``seconds`` in all for the command's output (``None``: no
        bound); one that gets nothing returns what it has, short, as if the output ended there,
        without ending the command."""
        if seconds is None:
            yield
            return
        self._deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self._deadline = None

    def _count(self, data: bytes) -> None:
        """Advance the position and the run of zero bytes the output ends with by ``data``."""
        if self._pos < 2:
            self._head += data[: 2 - self._pos]
        self._pos += len(data)
        trailing = len(data) - len(data.rstrip(b"\0"))
        self._zeros = self._zeros + trailing if trailing == len(data) else trailing

    def finish(self) -> None:
        """The shard was read to its end: read what the command still writes (``_drain``), stop
        reading, wait for the command, check its status."""
        assert self.proc.stdout is not None
        started = time.monotonic()
        self._drain()
        self.proc.stdout.close()
        # one timeout for the reading on and the wait together (the review of the reading on), and
        # a moment to die of SIGPIPE after writing on (the review of that: a command still writing
        # when the timeout was spent was killed and failed the shard, its last sample lost)
        spent = time.monotonic() - started
        self._ended(None if self.timeout is None else max(self.EXIT_GRACE, self.timeout - spent))

    def _drain(self) -> None:
        """Read the command's output past the archive's end-of-archive marker to its end: a tar
        writer pads its last record (up to 10 KiB of zeros), and a command still writing them
        when the pipe closes fails. ``curl`` ignores SIGPIPE and exits 23 on the broken pipe:
        ``pipe:curl -s URL`` failed each shard whose padding came in a later write than its
        marker, losing its last sample (found by review, 2026-12-06). At most ``DRAIN_BYTES``
        bytes and ``timeout`` seconds (a stall before the padding, as a network gives, is waited
        for); after a plain tar, only while what comes is zeros (its padding): a command that
        writes anything else after its archive is ended by the closed pipe, as before the fix (a
        shell loop writing a byte every 10 ms was read on for ``timeout``, for hours with none,
        then killed: the review of the fix; a gzip archive's tail is compressed, read whole);
        and no longer than the command runs: a process it left in the background may hold the
        pipe open for good (``sh -c 'cat x.tar; (sleep 600 &)'`` waited ``timeout`` a shard)."""
        left = self.DRAIN_BYTES
        plain = not self._head.startswith(b"\x1f\x8b")
        end = None if self.timeout is None else time.monotonic() + self.timeout
        while left > 0:
            with self.at_most(self.DRAIN_POLL):
                chunk = self._read1(min(left, 1 << 16))
            if chunk == b"":
                return  # its end
            if chunk is None and self.proc.poll() is not None:
                return  # nothing more, and the command exited (what holds the pipe is not it)
            if plain and chunk and chunk.strip(b"\0"):
                return  # not a tar's padding: the command writes on after its archive
            if end is not None and time.monotonic() >= end:
                # it lingers, or writes on (checked after every read: a command writing a byte
                # every few ms read on for hours; the review of the fix)
                return
            if chunk is not None:
                left -= len(chunk)

    def _ended(self, wait: float | None = None) -> None:
        """Wait for the command to exit (``wait`` seconds; default ``timeout``), check its status."""
        status = self._wait(self.timeout if wait is None else wait)
        if status is None:
            self._kill()
            raise ShardError(
                f"the command of shard {self.shown} did not exit within {self.timeout:g} s after its "
                "archive was read; check the command, or raise timeout=",
                url=self.shown,
                kind="command",
            )
        self._check(status)

    def _wait(self, timeout: float | None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _check(self, status: int | None) -> None:
        if status is None or status in self.OK_STATUS:
            return
        self._stderr.seek(0, io.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - self.STDERR_SHOWN))
        tail = self._stderr.read().decode(errors="replace").strip()
        # (the command's own secrets too: a tool may echo the key it was given; found by review)
        tail = redact(redact_command(tail), command_secrets(self.command))
        said = f"; it said: {tail!r}" if tail else " (and wrote nothing to standard error)"
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        raise ShardError(
            f"the command of shard {self.shown} {how}{said}; run it in a shell to check it: its "
            "standard output must be the tar archive",
            url=self.shown,
            kind="command",
        )

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        """Stop reading; a command still running is ended (with its whole process group)."""
        if self.closed:
            return
        try:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            if self.proc.poll() is None:
                self._kill()
        finally:
            self._stderr.close()
            super().close()

    def __repr__(self) -> str:
        return f"<siftpipe pipe stream {self.shown}>"


def _version_of(f: Any) -> tuple[Any, ...] | None:
    """What tells one version of an opened object from another: its size and the first the
    file's details give of generation (GCS: changes with the contents only), ETag (S3, Azure),
    version id (an S3 object rewritten with the same bytes keeps its ETag: the same contents, not
    a change); a local file's size and modification time (not its inode, which FUSE mounts may
    not keep); ``None`` when nothing is known (a ``pipe:`` stream). An http(s) file's details hold
    its size only, and that is all compared: an ETag there would cost a request per open and can
    differ between the servers behind one name for the same bytes."""
    details = getattr(f, "details", None)
    if isinstance(details, Mapping):
        size = details.get("size")
        for name in ("generation", "ETag", "etag", "VersionId"):
            if details.get(name) is not None:
                return (("size", str(size)), (name, str(details[name])))
        if size is not None:
            return (("size", str(size)),)
    fileno = getattr(f, "fileno", None)
    if callable(fileno) and not isinstance(f, PipeStream):
        try:
            st = os.fstat(fileno())
        except (OSError, ValueError, io.UnsupportedOperation, AttributeError):
            return None
        return (("size", st.st_size), ("mtime_ns", st.st_mtime_ns))
    return None


def _describe_change(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    was, now = dict(before), dict(after)
    changed = [f"{k} {was.get(k)!s} -> {now.get(k)!s}" for k in {**was, **now} if was.get(k) != now.get(k)]
    return ", ".join(changed) or "its version changed"


class RetryingFile(_Readable):
    """A read-only stream over one shard that survives dropped connections.

    A read that fails with a transient error (or ends before the object's known size) closes the
    underlying file, waits, reopens the object and continues at the same byte offset."""

    def __init__(self, opener: ShardOpener, url: str, offset: int = 0) -> None:
        super().__init__()
        self.opener = opener
        self.url = url
        self.pos = offset
        self.size: int | None = None
        #: what identifies the object's version (size, ETag or version id, modification time), as
        #: first opened: a reconnect onto another version is an error, not a silent splice
        self.version: tuple[Any, ...] | None = None
        self._f: Any = None

    def _connect(self) -> None:
        self._f = self.opener._raw_open(self.url, self.pos)
        size = getattr(self._f, "size", None)
        self.size = size if isinstance(size, int) else None
        version = _version_of(self._f)
        if self.version is None:
            self.version = version
        elif version is not None and version != self.version:
            # reopened after a dropped connection onto another object under the same name: the
            # bytes from here on are not the rest of what was read, and a sample could mix both
            self._drop()
            shown = self.opener.redact(redact_url(self.url))
            raise ShardError(
                f"reading shard {shown} failed: the object changed while it was read (it was "
                f"replaced between the first open and the reconnect at byte {self.pos}; "
                f"{_describe_change(self.version, version)}): the samples handed on from it come "
                "from the version before. Write new shards under new names rather than over ones "
                "a job may be reading, or pass handler=warn_and_continue to skip such a shard",
                url=shown,
                kind="corrupt",
            )

    def _drop(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(Exception):  # the old connection is broken anyway
                f.close()

    def connect(self, count: bool = True) -> None:
        """Open the object (with retries), counted in ``opened`` if ``count``; raises
        ``ShardError`` if it cannot be opened."""

        def attempt() -> None:
            try:
                self._connect()
            except BaseException:
                self._drop()
                raise

        self.opener.retrying("opening", self.url, attempt)
        if count:
            self.opener.count("opened")

    def tell(self) -> int:
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError(f"read from a closed shard stream ({self.opener.redact(redact_url(self.url))})")
        want = -1 if n is None else n

        def attempt() -> bytes:
            if self._f is None:
                self._connect()
                self.opener.count("reopened")
            try:
                data = self._f.read(want)
                if not data and want != 0 and self.size is not None and self.pos < self.size:
                    raise ConnectionResetError(
                        f"the stream ended at byte {self.pos} of {self.size} (connection closed early)"
                    )
            except BaseException:
                self._drop()
                raise
            return bytes(data)

        data: bytes = self.opener.retrying("reading", self.url, attempt)
        self.pos += len(data)
        return data

    @property
    def pipe(self) -> PipeStream | None:
        """The ``pipe:`` command's output it reads, if it does."""
        return self._f if isinstance(self._f, PipeStream) else None

    def read_some(self, n: int) -> bytes:
        """``PipeStream.read_some`` for a ``pipe:`` shard (never retried: a command's output
        cannot be asked again), else ``read(n)``."""
        pipe = self.pipe
        if pipe is None:
            return self.read(n)
        data = pipe.read_some(n)
        self.pos += len(data)
        return data

    def finish(self) -> None:
        """The archive was read to its end: for a ``pipe:`` shard, check the command's exit
        status (``PipeStream.finish``); nothing for other shards."""
        if isinstance(self._f, PipeStream):
            self._f.finish()

    def close(self) -> None:
        self._drop()
        super().close()

    def __repr__(self) -> str:
        return f"<siftpipe shard stream {self.opener.redact(redact_url(self.url))} at byte {self.pos}>"


# ---------------------------------------------------------------------------------- tar -> samples

_META = re.compile(r"__[^/]*__($|/)")


#: Default of ``max_member_bytes``: the largest tar member read into memory (256 MiB).
MAX_MEMBER_BYTES = 256 * 2**20
#: Default of ``max_sample_bytes``: the most one sample's members may hold together (1 GiB).
MAX_SAMPLE_BYTES = 2**30
#: The largest pax or GNU long-name header read (1 MiB): tarfile reads one whole into memory.
MAX_EXTENDED_HEADER_BYTES = 2**20

_EXTENDED_TYPES = (
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
)


class _DuplicateMember(tarfile.ReadError, ValueError):
    """A second member for one field of a sample: a ``ValueError`` too, as webdataset raises it;
    reported as ``DuplicateFieldError``."""


class TarLimitError(tarfile.ReadError):
    """A tar member (or one sample's members, or an extended header) holds more bytes than the
    reader takes into memory at once; classified as kind ``too_large``."""


class _CheckedTarInfo(tarfile.TarInfo):
    """Notes on its TarFile when the archive ends without its end-of-archive marker, or a member
    header in the middle is corrupt (its checksum fails, a number field is garbage or its size is
    negative): stream-mode tarfile otherwise ends such an archive quietly at that point, as if it
    were complete, and the rest of the shard is lost without a word. Refuses an extended header
    (pax, GNU long name) larger than ``MAX_EXTENDED_HEADER_BYTES`` before tarfile reads it whole."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> _CheckedTarInfo:
        # tarfile.TarInfo.fromtarfile, with checks between reading a header and acting on it
        fileobj: Any = tarfile_.fileobj
        buf = fileobj.read(tarfile.BLOCKSIZE)
        try:
            obj = cls.frombuf(buf, tarfile_.encoding, tarfile_.errors)
        except tarfile.EOFHeaderError:  # type: ignore[attr-defined]
            # a zero block: the end-of-archive marker is two; one followed by a member's header
            # ends the archive early for tarfile, and every member after it was lost quietly
            buffered = getattr(fileobj, "buf", b"")  # what tarfile's stream read ahead already
            if len(buffered) >= tarfile.BLOCKSIZE:
                after = buffered[: tarfile.BLOCKSIZE]
            elif cls.pipe is not None:
                # a pipe: command may keep its output open after an archive that one zero block
                # ends: what follows is waited for for the command's `timeout` at most, then the
                # block is the end (until 2026-12-05 it was the end at once, and a lone zero
                # block, with the rest of the shard in the next piece of output, lost it quietly;
                # found by review, as was the wait for good the first fix made)
                with cls.pipe.at_most(cls.pipe.timeout):
                    after = fileobj.read(tarfile.BLOCKSIZE)
            else:
                after = fileobj.read(tarfile.BLOCKSIZE)
            if after and after.count(0) != len(after):
                tarfile_._siftpipe_corrupt = (  # type: ignore[attr-defined]
                    "a lone zero block, the end-of-archive marker's, with more of the archive after it"
                )
                raise tarfile.InvalidHeaderError("lone zero block") from None  # type: ignore[attr-defined]
            raise
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError):  # type: ignore[attr-defined]
            tarfile_._siftpipe_truncated = True  # type: ignore[attr-defined]
            raise
        except tarfile.InvalidHeaderError as exc:  # type: ignore[attr-defined]
            tarfile_._siftpipe_corrupt = str(exc)  # type: ignore[attr-defined]
            raise
        obj.offset = fileobj.tell() - tarfile.BLOCKSIZE
        if obj.size < 0:  # tarfile would move backwards in the stream, or end it quietly
            tarfile_._siftpipe_corrupt = f"member {obj.name!r} has a negative size"  # type: ignore[attr-defined]
            raise tarfile.InvalidHeaderError("negative size")  # type: ignore[attr-defined]
        if obj.type in _EXTENDED_TYPES and obj.size > MAX_EXTENDED_HEADER_BYTES:
            raise TarLimitError(
                f"an extended header (pax or GNU long name) before member {obj.name!r} holds "
                f"{obj.size} bytes, more than the {MAX_EXTENDED_HEADER_BYTES} a tar writer ever needs"
            )
        return obj._proc_member(tarfile_)  # type: ignore[attr-defined]

    #: The ``pipe:`` command's output the archive is read from, if it is (see ``_for``).
    pipe: PipeStream | None = None

    @classmethod
    def _for(cls, stream: Any) -> type[_CheckedTarInfo]:
        """The class to read ``stream``'s archive with: this one, or for a ``pipe:`` command's
        output a subclass that knows it (``pipe``)."""
        pipe = stream if isinstance(stream, PipeStream) else getattr(stream, "pipe", None)
        if not isinstance(pipe, PipeStream):
            return cls
        return type("_PipeTarInfo", (cls,), {"pipe": pipe})


_BASE_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
# tarfile's words for a header it cannot parse, said plainly
_HEADER_FAULTS = {
    "bad checksum": "its checksum does not match",
    "invalid header": "a number field holds garbage",
}


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # tarfile decodes undecodable bytes to lone surrogates
        return False
    return True


def local_path(url: str) -> str | None:
    """The file a local shard names, the ``__local_path__`` of its samples: a path as given, a
    ``file:`` URL's path; ``None`` for any other URL. (webdataset gives ``urlparse(url).path``:
    the same for every name without ``?``, ``#`` or ``;``, which it cuts off.)"""
    parsed = urlsplit(url)
    if parsed.scheme == "":
        return url
    if parsed.scheme == "file":
        return parsed.path
    return None


def rewrite_secrets() -> set[str]:
    """The credentials in the replacements of the ``GOPEN_REWRITE`` rules (see ``gopen_rewrite``)."""
    rules = os.environ.get("GOPEN_REWRITE")
    if not rules:
        return set()
    found: set[str] = set()
    for rule in rules.split(";"):
        found |= url_secrets(rule.partition("=")[2])
    return found


def gopen_rewrite(url: str) -> str:
    """``url`` rewritten by webdataset's ``GOPEN_REWRITE`` rules, as webdataset's ``gopen`` reads
    them: ``"prefix1=replacement1;prefix2=replacement2"``, each prefix a regular expression
    matched at the start, the first that changes ``url`` applied (a mirror, a local cache, a
    ``pipe:`` command). A shard read through a rewrite keeps its own URL in ``__url__``, errors
    and the audit log. With ``GOPEN_VERBOSE`` set it prints the rewrite; with ``WDS_SECURE`` set
    rules are refused (``ConfigError``), as webdataset refuses them."""
    rules = os.environ.get("GOPEN_REWRITE")
    if not rules:
        return url
    if os.environ.get("WDS_SECURE", "0") not in ("", "0"):
        raise ConfigError(
            "GOPEN_REWRITE is set and so is WDS_SECURE, which refuses URL rewrites (as in "
            "webdataset); unset one of them"
        )
    for rule in rules.split(";"):
        prefix, sep, replacement = rule.partition("=")
        if not sep:
            raise ConfigError(
                f"GOPEN_REWRITE rule {rule!r} has no '=': write rules as 'prefix=replacement', "
                "separated by ';'"
            )
        rewritten = re.sub("^" + prefix, replacement, url)
        if rewritten != url:
            if os.environ.get("GOPEN_VERBOSE", "0") not in ("", "0"):
                print(f"GOPEN REWRITE {redact_url(url)} -> {redact_url(rewritten)}")
            return rewritten
    return url


def _member_verdict(
    on_member_error: Callable[[Exception, str, str], bool], exc: Exception, name: str, doing: str
) -> tuple[bool, ShardError | None]:
    """What the handler makes of one member's error: (skip the member, the error that ends the
    shard as failed when the handler said stop). Neither: the shard ends there."""
    try:
        return on_member_error(exc, name, doing), None
    except ShardError as err:
        if not getattr(err, "_handler_stopped", False):
            raise
        return False, err


def iter_tar_samples(
    stream: Any,
    url: str,
    *,
    start: int = 0,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    max_member_bytes: int | None = MAX_MEMBER_BYTES,
    max_sample_bytes: int | None = MAX_SAMPLE_BYTES,
    on_member_error: Callable[[Exception, str, str], bool] | None = None,
) -> Iterator[tuple[dict[str, Any], int | None, str | None]]:
    """The samples of one tar stream, WebDataset style, each with where the next one starts.

    ``on_member_error(exc, name, doing)``: what an error on one member does (``doing``:
    ``"renaming or selecting"`` when ``rename_files`` or ``select_files`` raised, ``"reading"``
    for a second member of a sample's field), as webdataset's handler does per member: True
    skips that member, False ends the shard there (``None``: the error is raised).

    Members are grouped into samples by their name up to the first dot of the base name
    (``dir/00012.x.npy`` -> key ``dir/00012``, field ``x.npy``); each sample is a dict with
    ``__key__``, ``__url__`` and one ``bytes`` value per field. Yields ``(sample, next_offset,
    next_key)``: the byte offset (counting from the start of the object; ``start`` is where
    ``stream`` begins) of the tar header that starts the next sample, and that sample's key, or
    ``None`` after the last sample or when the archive is compressed (offsets are not seekable);
    ``(sample, None, "")`` where a sample follows but where and which is not known yet (a member
    that a handler may skip alone follows: a resume re-reads the shard and skips by count).
    ``__url__`` is ``url`` with any credential in it redacted (it ends up in logs and audits); a
    local shard's samples also carry ``__local_path__``, as webdataset's do (see ``local_path``).

    Hostile archives are bounded, checked before a member is read: a member larger than
    ``max_member_bytes`` bytes, or one that takes a sample's members past ``max_sample_bytes``
    bytes (each member counted with its 512-byte header, so that thousands of empty members of
    one key are bounded too), raises ``TarLimitError`` naming the member (``None``: no limit). A
    negative size, a corrupt header and a name that is not valid UTF-8 (a key no log can record)
    raise ``tarfile.ReadError``. Member names are only ever keys, never paths written to (``../x``
    and ``/x`` are keys like any other); links, devices, directories and members whose base name
    has no extension are skipped, as webdataset skips them.
    """
    path = local_path(url)
    url = redact(url, secret_values())  # the values of secret environment variables too
    source, gzipped = _gunzipped(stream)
    tf = tarfile.open(  # noqa: SIM115 - the caller closes the stream
        fileobj=source, mode="r|" if gzipped else "r|*", tarinfo=_CheckedTarInfo._for(stream)
    )
    seekable = not gzipped and getattr(tf.fileobj, "comptype", None) == "tar"
    current: dict[str, Any] | None = None
    held = 0  # bytes of the current sample's members, headers included
    stopped: ShardError | None = None
    for info in tf:
        tf.members = []  # type: ignore[attr-defined]  # stream mode keeps every TarInfo otherwise
        if not info.isreg():
            continue
        name = info.name
        if _META.match(name):
            continue
        if rename_files is not None or select_files is not None:
            try:
                if rename_files is not None:
                    name = rename_files(name)
                if select_files is not None and not select_files(name):
                    continue
            except Exception as exc:
                if on_member_error is None:
                    raise
                skip, stopped = _member_verdict(on_member_error, exc, name, "renaming or selecting")
                if skip:
                    continue
                break
        match = _BASE_EXT.match(name)
        if match is None:
            continue
        prefix, suffix = match.group(1), match.group(2).lower()
        if not _is_text(name):
            garbled = tarfile.ReadError(
                f"member {name.encode('utf-8', 'surrogateescape')!r} has a name that is not valid "
                "UTF-8: its key could not be recorded in logs; rename the member"
            )
            if current is not None and prefix != current["__key__"]:
                # the sample before it is whole. Where the next one starts is not known yet (a
                # handler may skip this member alone): a checkpoint here re-reads the shard and
                # skips by count. Before (found by review, 2026-12-05) the skipped member was
                # taken for the next sample, and the resume refused as "shard changed"
                yield current, None, ""
                current = None
            if on_member_error is None:
                raise garbled
            # one member's fault: a handler that goes on skips it alone and reads the rest of
            # the shard (until 2026-12-05 the shard's rest was lost with it)
            skip, stopped = _member_verdict(on_member_error, garbled, repr(name), "reading")
            if skip:
                continue
            break
        if current is not None and prefix != current["__key__"]:
            yield current, (start + info.offset if seekable else None), prefix
            current = None
        if current is None:
            held = 0
        if max_member_bytes is not None and info.size > max_member_bytes:
            raise TarLimitError(
                f"member {name!r} holds {info.size} bytes, more than max_member_bytes={max_member_bytes}"
            )
        held += tarfile.BLOCKSIZE + info.size
        if max_sample_bytes is not None and held > max_sample_bytes:
            raise TarLimitError(
                f"sample {prefix!r} holds more than max_sample_bytes={max_sample_bytes} bytes at member "
                f"{name!r} (its members with their 512-byte headers)"
            )
        member = tf.extractfile(info)
        data = member.read() if member is not None else b""
        if current is None:
            current = {"__key__": prefix, "__url__": url}
            if path is not None:
                current["__local_path__"] = path
        if suffix in current:
            duplicate = _DuplicateMember(
                f"sample {prefix!r} has two members with field {suffix!r}: the shard's members must "
                "be grouped by sample, one file per field"
            )
            if on_member_error is None:
                raise duplicate
            # one bad member, as webdataset judges it: a handler that goes on skips this member
            # only, and the sample keeps its first (found by review, 2026-12-05: the rest of the
            # shard was lost)
            skip, stopped = _member_verdict(on_member_error, duplicate, name, "reading")
            if skip:
                continue
            break
        current[suffix] = data
    if stopped is not None:
        if current is not None:  # whole: its members came before the one the handler stopped at
            yield current, None, None
        raise stopped
    if getattr(tf, "_siftpipe_truncated", False):
        raise tarfile.ReadError(
            f"the archive ends at byte {start + tf.offset} without its end-of-archive marker (truncated)"
        )
    corrupt = getattr(tf, "_siftpipe_corrupt", None)
    if corrupt is not None:
        raise tarfile.ReadError(
            f"the tar header at byte {start + tf.offset} is corrupt "
            f"({_HEADER_FAULTS.get(corrupt, corrupt)}); the rest of the shard cannot be read"
        )
    if isinstance(source, _Gunzip):
        # the gzip member's end, past the tar's end-of-archive blocks: its CRC and length (a
        # shard cut in its last 8 bytes, or changed where the tar did not read, was accepted
        # unchecked; found by review, 2026-12-05). Before the last sample is handed on, as a
        # CRC error found earlier would be
        source.check_member_end()
    if isinstance(stream, RetryingFile | PipeStream):
        stream.finish()  # a pipe: command that failed fails its shard, even after a whole archive
    if current is not None:
        yield current, None, None


class _Prefixed(_Readable):
    """``head`` (bytes already read from ``stream``), then the rest of ``stream``."""

    def __init__(self, head: bytes, stream: Any) -> None:
        super().__init__()
        self.head, self.stream = head, stream

    def read(self, n: int = -1) -> bytes:
        head = self.head
        if not head:
            return self.stream.read(n)
        self.head = b""
        if n is None or n < 0:
            return head + self.stream.read()
        if n <= len(head):
            self.head = head[n:]
            return head[:n]
        # as many bytes as asked, as the stream would give: a reader's block-sized reads stay
        # aligned with the stream's end (a short read there waits on a pipe that stays open)
        return head + self.stream.read(n - len(head))


class _Gunzip(_Readable):
    """A gzip stream's data, every member of it (a shard written by a parallel gzip, pigz or
    bgzip, is several members: tarfile's stream mode reads the first and called the shard
    truncated). A gzip stream that is corrupt or cut short is a ``tarfile.ReadError`` (a corrupt
    shard), never an ``OSError`` a reader would retry as the storage's.

    It reads its stream only for data it is asked for: a ``pipe:`` command that keeps its output
    open after its archive is not waited for (``gzip.GzipFile`` read on for output zlib already
    held, and waited for the command to exit; found by review, 2026-12-05). Each read holds at
    most the bytes asked for (a gzip bomb stays small)."""

    CHUNK = 64 * 1024  # compressed bytes read at a time

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self.stream = stream
        self.member: Any = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.pending = b""  # compressed bytes read and not yet given to the member
        self.ended = False

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            parts = []
            while chunk := self.read(self.CHUNK * 16):
                parts.append(chunk)
            return b"".join(parts)
        parts, got = [], 0
        while got < n and not self.ended:
            chunk = self._some(n - got)
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _more(self) -> bytes:
        data = self.stream.read(self.CHUNK)
        return bytes(data) if data else b""

    def check_member_end(self, limit: int = 1 << 20) -> None:
        """Decompress the current gzip member to its end, so that zlib checks its CRC and length
        (``tarfile.ReadError`` if either is wrong or the stream ends first), reading no further
        (a ``pipe:`` command that keeps its output open is not waited for). At most ``limit``
        bytes of data are read for it (a tar's end padding is a few KiB); past them, unchecked."""
        seen = 0
        try:
            while not self.member.eof and seen < limit:
                data = self.member.decompress(self.pending, self.CHUNK)
                self.pending = self.member.unconsumed_tail
                seen += len(data)
                if not data and not self.member.eof and not self.pending:
                    self.pending = self._more()
                    if not self.pending:
                        raise EOFError("the stream ended inside a gzip member")
        except (EOFError, zlib.error) as exc:
            raise tarfile.ReadError(f"the gzip stream is corrupt or cut short ({exc})") from None

    def _some(self, n: int) -> bytes:
        """Up to ``n`` bytes of data, at least one unless the stream ended (then ``ended``)."""
        try:
            while True:
                if self.member.eof:
                    # the member ended: another may follow (zero padding between is allowed)
                    rest = self.member.unused_data.lstrip(b"\0")
                    while not rest:
                        more = self._more()
                        if not more:
                            self.ended = True
                            return b""
                        rest = more.lstrip(b"\0")
                    self.member = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    self.pending = rest
                # output zlib holds comes first, with no new input (it may hold some after
                # taking all of its input)
                data = self.member.decompress(self.pending, n)
                self.pending = self.member.unconsumed_tail
                if data:
                    return data
                if self.member.eof:
                    continue
                if not self.pending:
                    self.pending = self._more()
                    if not self.pending:
                        raise EOFError("the stream ended inside a gzip member")
        except (EOFError, zlib.error) as exc:
            raise tarfile.ReadError(f"the gzip stream is corrupt or cut short ({exc})") from None


def _gunzipped(stream: Any) -> tuple[Any, bool]:
    """``stream`` to read a tar from, and whether it is a gzip stream's data (any other
    compression is left to tarfile's own detection)."""
    head = b""
    while len(head) < 2:
        chunk = stream.read(2 - len(head))
        if not chunk:
            break
        head += chunk
    prefixed = _Prefixed(head, stream)
    if head == b"\x1f\x8b":
        if callable(getattr(stream, "read_some", None)):
            # the decompressor reads on until it has what it needs: fed what has arrived, it
            # does not wait past the archive for a command that lingers (a full read of 128 KiB
            # waited for it to exit; found by review, 2026-12-05)
            return _Gunzip(_Prefixed(head, _SomeOf(stream))), True
        return _Gunzip(prefixed), True
    return prefixed, False


class _SomeOf(_Readable):
    """``stream`` read with its ``read_some``: what has arrived, up to the size asked."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self.stream = stream

    def read(self, n: int = -1) -> bytes:
        return bytes(self.stream.read_some(n if n is not None else -1))


#: webdataset's handlers (and siftpipe's of the same names) that skip or stop, never raise
_SKIPPING_HANDLERS = frozenset(
    {"warn_and_continue", "ignore_and_continue", "warn_and_stop", "ignore_and_stop"}
)
_HANDLER_HINT = re.compile(r"(?:,? or |; )pass handler=warn_and_continue to skip [^;]*$")


def _without_handler_hint(err: ShardError) -> ShardError:
    """``err`` without its advice to pass ``handler=warn_and_continue``: the warning of a handler
    that skips already (it read "... or pass handler=warn_and_continue to skip it")."""
    message = _HANDLER_HINT.sub("", str(err))
    if message == str(err):
        return err
    return type(err)(message, url=err.url, key=err.key, kind=err.kind)


class ShardReader:
    """Pipeline stage: shard URLs (or webdataset's ``{"url": ...}`` dicts) in, samples out.

    Args:
        opener: Opens the URLs (storage options, retries).
        handler: What to do with a shard that cannot be opened or read (after retries):
            ``reraise_exception`` (default) raises its ``ShardError``; ``warn_and_continue``
            warns and skips it; ``ignore_and_continue``; ``warn_and_stop``; any webdataset
            handler. Samples already handed on from a failed shard stay handed on. Every
            skipped shard is counted in ``shard_stats().skipped``.
        select_files: Keep only tar members whose name passes this predicate.
        rename_files: Rename tar members before grouping.
        max_member_bytes: The largest tar member read, in bytes (default ``MAX_MEMBER_BYTES``,
            256 MiB; ``None``: no limit). A larger one fails its shard (kind ``too_large``,
            naming the shard and the member) before any of it is read.
        max_sample_bytes: The most one sample's members may hold together, in bytes, each
            member counted with its 512-byte tar header (default ``MAX_SAMPLE_BYTES``, 1 GiB;
            ``None``: no limit); bounds a sample of thousands of members as well.
    """

    def __init__(
        self,
        opener: ShardOpener,
        handler: Handler = reraise_exception,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        *,
        max_member_bytes: int | None = MAX_MEMBER_BYTES,
        max_sample_bytes: int | None = MAX_SAMPLE_BYTES,
    ) -> None:
        for name, value in (("max_member_bytes", max_member_bytes), ("max_sample_bytes", max_sample_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(
                    f"{name} must be a number of bytes >= 1, or None for no limit; got {value!r}"
                )
        self.opener = opener
        self.handler = handler
        self.select_files = select_files
        self.rename_files = rename_files
        self.max_member_bytes = max_member_bytes
        self.max_sample_bytes = max_sample_bytes

    def tar_samples(
        self, stream: Any, url: str, start: int = 0, *, judged: Callable[[], bool] | None = None
    ) -> Iterator[tuple[dict[str, Any], int | None, str | None]]:
        """``iter_tar_samples`` of ``stream`` with this reader's member selection and limits.

        ``judged()``: True while the members read lie before a checkpoint's position (a resume
        that re-reads a shard and skips samples by count): a bad member there was judged by the
        handler before the checkpoint, and is skipped again without asking or counting it twice."""

        def member_error(exc: Exception, name: str, doing: str) -> bool:
            if judged is not None and judged():
                # the handler skipped it before the checkpoint: samples after it were read then
                # (found by review, 2026-12-05: it was asked again, and counted twice)
                return True
            # the handler judges one member, as webdataset's does: a bad one is skipped, not the
            # rest of the shard (a handler that raises fails the shard, as before). Skipped, it is
            # counted (members_skipped); a handler that says stop ends the shard there and the
            # next is read, as in webdataset, the shard counted skipped (before, it was counted
            # completed, and nothing said a member or the shard's rest was missing; found by
            # review, 2026-12-05)
            err = self.opener.error(exc, url, what=f"{doing} member {name!r} of")
            try:
                go_on = self.handler(err)
            except Exception as raised:
                # the handler raised (reraise_exception, or one that logs first): it was asked
                # once, and what it raised goes to the caller as it is (found by review,
                # 2026-12-05: the handler was asked again, with the error wrapped)
                with contextlib.suppress(AttributeError, TypeError):
                    raised._handler_raised = True  # type: ignore[attr-defined]
                raise
            if go_on:
                self.opener.count("members_skipped")
                return True
            err._handler_stopped = True  # type: ignore[attr-defined]  # (handle: asked already)
            raise err

        return iter_tar_samples(
            stream,
            url,
            start=start,
            select_files=self.select_files,
            rename_files=self.rename_files,
            max_member_bytes=self.max_member_bytes,
            max_sample_bytes=self.max_sample_bytes,
            on_member_error=member_error,
        )

    def __repr__(self) -> str:
        return f"ShardReader({self.opener!r}, handler={getattr(self.handler, '__name__', self.handler)})"

    def __call__(self, src: Iterable[Any]) -> Iterator[dict[str, Any]]:
        for item in src:
            url = item["url"] if isinstance(item, Mapping) else item
            if not isinstance(url, str):
                raise ConfigError(f"a shard list must hold URL strings, got {type(url).__name__}")
            state: dict[str, Any] = {}
            yield from self.samples(url, state=state)
            if state.get("stop"):
                return

    def samples(self, url: str, *, state: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """The samples of one shard; a failure goes to the handler (``state['stop']`` if it stops)."""
        key: str | None = None
        err: ShardError | None = None
        try:
            stream = self.opener.open(url)
            try:
                for sample, _, _ in self.tar_samples(stream, url):
                    key = sample["__key__"]
                    self.opener.count("samples")
                    yield sample
            finally:
                stream.close()
            self.opener.count("completed")
            return
        except ConfigError:  # a setting, not a shard, is wrong: skipping shards would hide it
            raise
        except Exception as exc:  # handed to the handler below
            if getattr(exc, "_handler_raised", False):
                self.opener.count("failed")  # the handler was asked, for one of its members
                raise
            err = self.opener.error(exc, url, key)
            if err.key is None and key is not None:
                stopped = getattr(err, "_handler_stopped", False)
                err = ShardError(f"{err} (last sample read: {key!r})", url=err.url, key=key, kind=err.kind)
                if stopped:
                    err._handler_stopped = True  # type: ignore[attr-defined]
            del exc
        self.handle(err, state)

    def handle(self, err: ShardError, state: dict[str, Any] | None = None) -> None:
        """Apply the handler to ``err``: count the shard as skipped or failed, or stop."""
        if getattr(err, "_handler_stopped", False):
            # a member's error the handler already answered with stop: as in webdataset, the
            # shard ends there and the next one is read; the shard counts as skipped
            go_on = True
        else:
            if getattr(self.handler, "__name__", None) in _SKIPPING_HANDLERS:
                err = _without_handler_hint(err)
            try:
                go_on = self.handler(err)
            except BaseException:
                self.opener.count("failed")
                raise
        count_here("skipped")
        self.opener.counts.note_skip(err.url, err.kind)
        log.info("skipped %s", err)
        if not go_on and state is not None:
            state["stop"] = True
