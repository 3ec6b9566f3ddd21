"""Whole-file writes to any fsspec filesystem: a reader sees the old file or the new one, never a
part (the audit log's parts and manifests, a published score memory and its ``latest.json``)."""

from __future__ import annotations

import errno
import math
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = [
    "RETRY_TIMEOUT",
    "answer_of",
    "check_retry_timeout",
    "may_pass",
    "put_whole",
    "retrying",
    "storage_error",
]

T = TypeVar("T")


def put_whole(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` on the fsspec filesystem ``fs``, whole or not at all.

    An object store's PUT is whole already. A local file is written aside, as
    ``_tmp-<random>-<name>.partial`` beside it (a name no ``*.parquet`` or ``*.json`` glob takes
    for a file of the directory, nor two writers share), then renamed over ``path``; a failed
    write leaves no aside file behind (a kill between the write and the rename does)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if "file" not in protocols and "local" not in protocols:
        fs.pipe_file(path, data)
        return
    parent = fs._parent(path)
    fs.makedirs(parent, exist_ok=True)
    aside = f"{parent}/_tmp-{secrets.token_hex(4)}-{path.rsplit('/', 1)[-1]}.partial"
    try:
        with fs.open(aside, "wb") as f:
            f.write(data)
        fs.mv(aside, path)
    finally:
        if fs.exists(aside):
            fs.rm(aside)


#: Seconds a publication of the score memory (and a worker's record of the samples it dropped
#: before decode) is retried while storage fails in a way that may pass, as the audit log's writes
#: are (``AuditLog(retry_timeout=)``).
RETRY_TIMEOUT = 120.0


def check_retry_timeout(timeout: Any, name: str = "retry_timeout") -> float:
    """``timeout`` as seconds, or ``ConfigError`` unless it is a finite number >= 0."""
    from ..errors import ConfigError  # (here: the audit writer process imports this module)

    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (0 <= timeout < math.inf):
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def retrying(
    write: Callable[[], T],
    what: str,
    timeout: float = RETRY_TIMEOUT,
    say: Callable[[str], None] | None = None,
) -> T:
    """``write()``, tried again with backoff (0.5 s, doubling to 10 s) while it fails in a way that
    may pass (``may_pass``: a refused or reset connection, a timeout, anywhere in
    the error's chain), for ``timeout`` seconds from the first try; past it, a ``SiftError``
    naming ``what`` (which must hold no credential), the attempts and the cause's type, never its
    text (it may quote a URL with credentials). Another failure is raised as it is. A 5xx or
    429 answer (s3fs's ``OSError(EBUSY)`` for S3's SlowDown) is retried too, as the audit log's
    writes retry it. ``say``: told once, at the first retry, what is waited for.

    Found by review, 2026-12-05: a storage outage of 8 s failed ``publish_memory`` and the workers'
    drop records with botocore's raw ``EndpointConnectionError``, which s3fs had retried for about
    4 s; the audit log in the same bucket rode out 600 s."""
    from ..errors import SiftError  # (here: the audit writer process imports this module)

    timeout = check_retry_timeout(timeout)
    started = time.monotonic()
    wait, attempts = 0.5, 0
    while True:
        attempts += 1
        try:
            return write()
        except Exception as exc:
            if not _may_pass_in_chain(exc):
                raise  # (as before: what cannot pass is the caller's to name)
            if attempts == 1 and say is not None and timeout > wait:
                say(
                    f"siftpipe: {what}: the storage did not answer ({type(exc).__name__}); "
                    f"trying again for up to {timeout:g} s"
                )
            took = time.monotonic() - started
            if took + wait > timeout:
                raise SiftError(
                    f"{what} failed after {attempts} attempt(s) over {took:.1f} s: "
                    f"{type(exc).__name__}; the storage did not answer within {timeout:g} s: "
                    "check the endpoint and the network"
                ) from None
            del exc
        time.sleep(wait)
        wait = min(wait * 2, 10.0)


def storage_error(what: str, exc: OSError, then: str = "") -> Exception:
    """``SiftError`` for a storage failure of ``what`` (whose URL is shown redacted): the cause's
    errno text, never the error's own (it may quote a URL with credentials or a temporary file's
    name); ``then``: what it means, appended. A bare ``OSError [Errno 28]`` named neither the file
    nor the fix (found by review, 2026-12-06)."""
    from ..errors import SiftError  # (here: the audit writer process imports this module)

    reason = exc.strerror or type(exc).__name__
    return SiftError(
        f"{what} failed: {reason}{f' (errno {exc.errno})' if exc.errno else ''}; check the "
        f"destination's free space and permissions{then}"
    )


def _may_pass_in_chain(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        if may_pass(cur) or _busy(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _busy(exc: BaseException) -> bool:
    """A 5xx or 429 answer: botocore's or aiohttp's, or s3fs's ``OSError(EBUSY)`` for S3's
    SlowDown/503."""
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return True
    status = answer_of(exc)[1]
    return status is not None and (status >= 500 or status == 429)


def answer_of(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore ClientError or an aiohttp response error."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        code = response.get("Error", {}).get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return (str(code) if code is not None else None), (int(status) if status else None)
    status = getattr(exc, "status", None)
    if isinstance(status, int) and type(exc).__module__.startswith("aiohttp"):
        return None, status
    return None, None


def may_pass(exc: BaseException) -> bool:
    """Whether ``exc`` itself (not its causes) is a failure that may pass on a retry: a refused,
    reset or dropped connection, a timeout, from the standard library, botocore, aiohttp, urllib3,
    http.client, requests or fsspec. Shared by the shard reader's retries and ``retrying``."""
    if isinstance(exc, ConnectionError | TimeoutError | socket.timeout):
        return True
    name = type(exc).__name__
    module = type(exc).__module__
    if module.startswith("botocore"):
        return any(
            c.__name__ in ("ConnectionError", "HTTPClientError", "ReadTimeoutError", "ConnectTimeoutError")
            for c in type(exc).__mro__
        )
    if module.startswith("aiohttp"):
        return any(
            c.__name__ in ("ClientConnectionError", "ClientPayloadError", "ServerTimeoutError")
            for c in type(exc).__mro__
        )
    if module.startswith(("urllib3", "http.client", "requests")):
        return name in (
            "IncompleteRead",
            "RemoteDisconnected",
            "ProtocolError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "NewConnectionError",
            "ConnectionError",
            "ChunkedEncodingError",
            "ReadTimeout",
            "ConnectTimeout",
        )
    return name == "FSTimeoutError"
