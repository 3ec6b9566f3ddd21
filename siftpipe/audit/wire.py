"""Encoding audit parts, and writing them: Parquet, fsspec, retries, manifests.

This module runs in the training process (encoding; the thread writer) and in the audit writer
process. It imports only the standard library, numpy, pyarrow and fsspec (never torch), so the
writer process starts fast; the process loads it by path, without the package's ``__init__``.

A part travels as one frame: ``<u32 header length><u32 payload length><header JSON><payload>``.
The header names the payload's buffers (name, dtype, size) and carries the per-chunk values; the
payload is the raw column buffers. No pickle, in the log or on the wire.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import IO, Any

import numpy as np

from .._secrets import redact, redact_json, redact_url
from ..core.files import put_whole
from ..core.vocab import REASONS, SOURCES, loggable_text

_FRAME = struct.Struct("<II")
#: The log's format, in every manifest, claim and end marker a writer makes (``"format"``); a
#: reader refuses a log of a later one, which it would misread
FORMAT_VERSION = 1
#: The advice a write error ends with (a close that could not write its end marker drops it: the
#: records are all written, and on_full="drop" would not write the marker either)
DROP_ADVICE = "; with on_full='drop' the run continues and counts what is lost"
#: Columns of every part, in order (``run`` and ``rank`` come from the path).
COLUMNS: tuple[str, ...] = (
    "worker",
    "seq",
    "epoch",
    "key",
    "url",
    "loss",
    "score",
    "prob",
    "kept",
    "weight",
    "reason",
    "source",
    "micro_batch",
    "model_version",
    "time",
)
#: Files of one attempt in a rank's directory (parts, manifests, end markers, claims, notes of
#: rows never handed on).
_ATTEMPT_FILE = re.compile(
    r"(?:part-\d+-(?P<attempt>[0-9a-f]+)\.parquet)"
    r"|(?:(?:_manifest-\d+-|_end-|_claim-)(?P<json>[0-9a-f]+)\.json)"
    r"|(?:_unhanded-(?P<note>[0-9a-f]+)-\d+\.json)"
)

# dictionaries only where values repeat and statistics only where readers filter: per-key
# dictionaries and min/max of unique strings cost more to write than they save
_DICTIONARY_COLUMNS = ["url", "reason", "source", "epoch", "worker", "model_version"]
_STATISTICS_COLUMNS = ["seq", "epoch", "kept", "model_version", "micro_batch"]


# ---------------------------------------------------------------------- encoding (training process)


def encode_part(
    chunks: Sequence[Mapping[str, Any]],
    header: dict[str, Any],
    clean_url: Callable[[str], str] = redact_url,
) -> tuple[dict[str, Any], list[Any]]:
    """The header and payload buffers of a part made of ``chunks`` (one per decided group).

    Cheap on purpose: it runs on the training thread and holds the GIL, so strings are joined in
    C rather than converted one by one, and numeric columns are concatenated as they are.
    ``clean_url`` removes credentials from each distinct URL (a sample's ``__url__`` may be a
    presigned or password-bearing URL) before it is recorded.
    """
    n = [int(c["n"]) for c in chunks]
    total = sum(n)
    buffers: list[tuple[str, np.ndarray | bytes]] = []

    def column(name: str, dtype: Any, fill: float) -> None:
        values = [np.full(c["n"], fill, dtype) if c[name] is None else c[name] for c in chunks]
        buffers.append((name, np.ascontiguousarray(np.concatenate(values), dtype=dtype)))

    column("loss", np.float64, np.nan)
    column("score", np.float32, np.nan)
    column("prob", np.float32, np.nan)
    column("kept", np.bool_, False)
    column("weight", np.float32, 1.0)
    column("reason", np.int8, 0)
    buffers.append(
        (
            "source",
            np.concatenate(
                [
                    np.full(c["n"], c["source"], np.int8)
                    if np.isscalar(c["source"])
                    else np.asarray(c["source"], np.int8)
                    for c in chunks
                ]
            ),
        )
    )
    if any(c["workers"] is not None for c in chunks):
        column("workers", np.int32, -1)

    # urls: a dictionary (shard URLs repeat); a group from one shard costs no per-row work
    uniques: dict[str, int] = {}  # recorded (credential-free) URL -> code
    code_of: dict[Any, int] = {}  # URL as the sample carried it -> code

    def code(url: Any) -> int:
        found = code_of.get(url)
        if found is None:
            found = code_of[url] = (
                -1 if url is None else uniques.setdefault(loggable_text(clean_url(str(url))), len(uniques))
            )
        return found

    codes = []
    for c in chunks:
        urls = c["urls"]
        if urls is None:
            codes.append(np.full(c["n"], -1, np.int32))
        elif isinstance(urls, tuple):  # (url, n)
            codes.append(np.full(c["n"], code(urls[0]), np.int32))
        else:
            codes.append(np.fromiter((code(u) for u in urls), np.int32, c["n"]))
    url_codes = np.concatenate(codes) if codes else np.zeros(0, np.int32)
    buffers.append(("url_codes", url_codes))
    url_values: list[str | None] = list(uniques)
    no_url = bool(np.count_nonzero(url_codes < 0))  # rows that carried no __url__

    # keys: one NUL-joined UTF-8 blob, split again by the writer
    key_format = "none"
    if any(c["keys"] is not None for c in chunks):
        lists: list[Sequence[Any]] = [c["keys"] if c["keys"] is not None else [None] * c["n"] for c in chunks]
        try:
            blob = "\x00".join(chain.from_iterable(lists)).encode()
            key_format = "joined" if blob.count(0) == total - 1 else "json"
        except (TypeError, UnicodeEncodeError):  # None or non-string keys; a key not valid UTF-8
            key_format = "json"
        if key_format == "json":
            blob = json.dumps(
                [None if k is None else loggable_text(str(k)) for k in chain.from_iterable(lists)]
            ).encode()
        buffers.append(("keys", blob))

    header = {
        **header,
        "op": "part",
        "rows": total,
        "chunk_rows": n,
        "seq0": [int(c["seq0"]) for c in chunks],
        "epoch": [int(c["epoch"]) for c in chunks],
        "model_version": [int(c["model_version"]) for c in chunks],
        "time": [float(c["time"]) for c in chunks],
        "micro_batch0": [int(c["micro_batch0"]) for c in chunks],
        "chunk": [int(c["chunk"]) for c in chunks],
        "url_values": url_values,
        "no_url": no_url,
        "key_format": key_format,
        "buffers": [
            [name, str(value.dtype) if isinstance(value, np.ndarray) else "bytes", nbytes(value)]
            for name, value in buffers
        ],
    }
    return header, [value for _, value in buffers]


def nbytes(value: np.ndarray | bytes) -> int:
    return int(value.nbytes) if isinstance(value, np.ndarray) else len(value)


def frame(header: Mapping[str, Any], buffers: Sequence[Any] = ()) -> list[Any]:
    """The pieces of one frame, ready to write in order."""
    head = json.dumps(header).encode()
    size = sum(nbytes(b) for b in buffers)
    return [_FRAME.pack(len(head), size), head, *(memoryview(b).cast("B") for b in buffers)]


def read_frame(stream: IO[bytes]) -> tuple[dict[str, Any], memoryview] | None:
    """The next frame from ``stream``, or None at its end."""
    prefix = stream.read(_FRAME.size)
    if len(prefix) < _FRAME.size:
        return None
    head_size, payload_size = _FRAME.unpack(prefix)
    header = json.loads(stream.read(head_size))
    payload = stream.read(payload_size)
    if len(payload) < payload_size:
        return None  # the sender died mid-frame: that part never arrived whole
    return header, memoryview(payload)


def decode_part(header: Mapping[str, Any], payload: memoryview | bytes) -> Any:
    """The Arrow table of a part from its header and payload."""
    import pyarrow as pa

    views: dict[str, Any] = {}
    at = 0
    for name, dtype, size in header["buffers"]:
        chunk = payload[at : at + size]
        views[name] = bytes(chunk) if dtype == "bytes" else np.frombuffer(chunk, dtype=dtype)
        at += size
    n = np.asarray(header["chunk_rows"], np.int64)
    total = int(header["rows"])
    starts = np.repeat(np.asarray(header["seq0"], np.int64), n)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    chunk_size = np.maximum(1, np.repeat(np.asarray(header["chunk"], np.int64), n))
    micro = np.repeat(np.asarray(header["micro_batch0"], np.int64), n) + within // chunk_size

    codes = views["url_codes"]
    url_values = header["url_values"]
    if url_values:
        url = pa.DictionaryArray.from_arrays(
            pa.array(codes, mask=codes < 0), pa.array(url_values, pa.string())
        )
    else:
        url = pa.DictionaryArray.from_arrays(pa.nulls(total, pa.int32()), pa.array([], pa.string()))
    columns = {
        "worker": pa.array(views["workers"] if "workers" in views else np.full(total, -1, np.int32)),
        "seq": pa.array(starts + within),
        "epoch": pa.array(np.repeat(np.asarray(header["epoch"], np.int32), n)),
        "key": _keys(header["key_format"], views.get("keys"), total),
        "url": url,
        "loss": pa.array(views["loss"]),
        "score": pa.array(views["score"]),
        "prob": pa.array(views["prob"]),
        "kept": pa.array(views["kept"]),
        "weight": pa.array(views["weight"]),
        "reason": pa.DictionaryArray.from_arrays(pa.array(views["reason"]), pa.array(list(REASONS))),
        "source": pa.DictionaryArray.from_arrays(pa.array(views["source"]), pa.array(list(SOURCES))),
        "micro_batch": pa.array(micro),
        "model_version": pa.array(np.repeat(np.asarray(header["model_version"], np.int64), n)),
        "time": pa.array(np.repeat(np.asarray(header["time"], np.float64), n)),
    }
    return pa.table(columns)


def _keys(key_format: str, blob: bytes | None, total: int) -> Any:
    import pyarrow as pa

    if key_format == "none" or blob is None:
        return pa.nulls(total, pa.string())
    if key_format == "json":
        return pa.array(json.loads(blob), pa.string())
    raw = np.frombuffer(blob, dtype=np.uint8)
    if total == 0:
        return pa.array([], pa.string())
    ends = np.flatnonzero(raw == 0)
    offsets = np.empty(total + 1, dtype=np.int64)
    offsets[0] = 0
    offsets[1:total] = ends - np.arange(total - 1)
    offsets[total] = raw.size - (total - 1)
    data = raw[raw != 0] if total > 1 else raw
    return pa.LargeStringArray.from_buffers(total, pa.py_buffer(offsets), pa.py_buffer(data)).cast(
        pa.string()
    )


# ---------------------------------------------------------------------- writing (thread or process)

#: botocore's exceptions for a request that can never succeed as made (matched by name: the
#: writer process does not import botocore unless the filesystem does).
_PERMANENT_BY_NAME = {
    "NoCredentialsError": "no credentials were found",
    "PartialCredentialsError": "the credentials are incomplete",
    "ParamValidationError": "the request is invalid (a bucket name, say)",
    "NoRegionError": "no region is configured",
    "UnknownServiceError": "the storage service is unknown",
    "InvalidConfigError": "the storage options are invalid",
}


def permanent_cause(exc: BaseException) -> str | None:
    """What makes ``exc`` a failure that retrying cannot cure, with the fix; None if it may pass
    (a connection refused or reset, a timeout, a 5xx answer: an outage is retried)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _PERMANENT_BY_NAME:
            return f"{_PERMANENT_BY_NAME[cls.__name__]}: check the storage options and credentials"
    if isinstance(exc, FileNotFoundError):
        return "the bucket or container does not exist: create it, or check the URL and endpoint_url"
    if isinstance(exc, PermissionError):
        return (
            "access denied or invalid credentials: check the credentials (storage options, "
            "environment, profile) and the destination's permissions"
        )
    if isinstance(exc, ImportError) or (isinstance(exc, ValueError) and "protocol" in str(exc).lower()):
        return "no filesystem for this URL's protocol: check the URL, or install the fsspec package for it"
    if isinstance(exc, TypeError):
        return "a storage option this filesystem does not take: check the storage options"
    if isinstance(exc, ValueError | NotADirectoryError | IsADirectoryError | NotImplementedError):
        return "the destination cannot be written as given: check the URL and storage options"
    return None


class PartWriter:
    """Writes parts and small JSON objects under the log's root, retrying transient failures."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        compression: str,
        retry_timeout: float,
        secrets: Sequence[str],
        give_up_after_failure: bool = False,
    ) -> None:
        self.url = url
        self.storage_options = dict(storage_options)
        self.compression = compression
        self.retry_timeout = retry_timeout
        self.secrets = list(secrets)
        # when a failure ends the log (on_full="block"), later frames are not retried again
        self.give_up_after_failure = give_up_after_failure
        self.failed: str | None = None
        self.claim: Mapping[str, Any] | None = None  # a claim still to make (on_full="drop")
        self._fs: Any = None
        self.noted = False  # a write retried past NOTE_AFTER was said on standard error

    def handle(self, header: Mapping[str, Any], payload: memoryview | bytes) -> dict[str, Any]:
        """Do what a frame asks; the reply says how it went (errors already redacted).

        A reply with ``"fatal": True`` ends the log whatever ``on_full`` says (another job's
        records are in the way)."""
        op = header.get("op")
        if self.failed is not None:
            return {
                "op": op,
                "part": header.get("part"),
                "ok": False,
                "error": f"not written: an earlier write failed ({self.failed})",
            }
        try:
            claim = header if op == "claim" else self.claim if op in ("part", "json") else None
            if claim is not None:
                self.claim = None
                try:
                    reply = self._claim(claim)
                except Exception:
                    if not self.give_up_after_failure:
                        self.claim = claim  # on_full="drop": claim again before the next write
                    raise
                if not reply["ok"]:
                    self.failed = reply["error"]
                    return {**reply, "op": op, "part": header.get("part"), "fatal": True}
                if op == "claim":
                    return reply
            if op == "part":
                return self._part(header, payload)
            if op == "release":
                self._filesystem().rm_file(self._filesystem()._strip_protocol(header["path"]))
                return {"op": "release", "ok": True}
            if op == "json":
                retries = self._retrying(
                    lambda: self._put(header["path"], self._json(header["body"])),
                    f"write {header['path'].rsplit('/', 1)[-1]}",
                )
                return {"op": "json", "ok": True, "retries": retries}
            raise ValueError(f"unknown operation {op!r}")
        except Exception as exc:
            error = self.safe(exc)
            if "of the audit log at" not in error:
                error = f"cannot write to the audit log at {redact(self.url, self.secrets)}: {error}"
            if self.give_up_after_failure:
                self.failed = error
            return {
                "op": op,
                "part": header.get("part"),
                "ok": False,
                "error": error,
                "fatal": self.give_up_after_failure,
            }

    def _claim(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """Write this attempt's claim, then refuse if the directory holds another job's files.

        A fresh job (``resumed`` false) may share its directory with nobody; a resumed one only
        with attempts of its own job (``origin``). Claim first, list second: of two writers that
        start together, the second to list sees the first's claim, so at most one goes on (both
        stop when both list after both claimed: refused, never mixed)."""
        body = header["body"]
        directory, attempt = header["directory"], header["attempt"]
        path = f"{directory}/_claim-{attempt}.json"
        retries = self._retrying(lambda: self._put(path, self._json(body)), "write the claim")
        others: dict[str, list[str]] = {}
        retries += self._retrying(
            lambda: others.update(self._attempts_in(directory, exclude=attempt)), "list the directory"
        )
        foreign = {}
        for other, names in sorted(others.items()):
            origin: str | None = "?"
            if body.get("resumed"):
                origin, more = self._origin_of(directory, names)
                retries += more
                if body.get("origin") is None or origin in (None, body["origin"]):
                    continue  # its own job's earlier attempt (or a log too old to tell: trusted)
            foreign[other] = origin
        if not foreign:
            return {"op": "claim", "ok": True, "retries": retries}
        with contextlib.suppress(Exception):
            fs = self._filesystem()
            fs.rm_file(fs._strip_protocol(path))
        where = redact(directory, self.secrets)
        listed = ", ".join(sorted(foreign)[:5])
        listed += f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        source = body.get("run_id_from", "run_id=")
        if body.get("resumed"):
            why = (
                f"it resumes job {body.get('origin')}, but {where} also holds attempt(s) {listed} of "
                "another job with the same run id"
            )
        else:
            why = f"{where} already holds attempt(s) {listed} of another job"
        # (a note of rows never handed on is written only after a part; alone, it holds no record)
        bare = sorted(a for a in foreign if all(n.startswith(("_claim-", "_unhanded-")) for n in others[a]))
        if bare:
            # a job killed before its first part leaves its claim alone; so does one running now
            why += (
                f" (attempt(s) {', '.join(bare[:5])} left only a claim, {where}/_claim-{bare[0]}.json"
                f"{' and others' if len(bare) > 1 else ''}, no records: a job killed before it wrote "
                "its first part, or one running now before it; if that job is dead, delete its "
                "claim and run again)"
            )
        return {
            "op": "claim",
            "ok": False,
            "error": (
                f"audit run id {body.get('run')!r} (from {source}) collides: {why}. A job never "
                "supersedes another job's records: give this job a run id no other job used (or leave "
                "run_id= and $SIFTPIPE_RUN_ID unset for a new one), or, to continue that job, resume "
                "it from its checkpoint (Sifter.load_state_dict)"
            ),
        }

    def _attempts_in(self, directory: str, exclude: str) -> dict[str, list[str]]:
        """The attempts with files in ``directory`` other than ``exclude``: their file names."""
        fs = self._filesystem()
        path = fs._strip_protocol(directory)
        fs.invalidate_cache(path)  # a listing cached before the claim was written would miss writers
        try:
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
        except FileNotFoundError:
            return {}
        found: dict[str, list[str]] = {}
        for name in names:
            m = _ATTEMPT_FILE.fullmatch(name)
            attempt = m and (m["attempt"] or m["json"] or m["note"])
            if attempt and attempt != exclude:
                found.setdefault(attempt, []).append(name)
        return found

    def _origin_of(self, directory: str, names: Sequence[str]) -> tuple[str | None, int]:
        """The job (origin) an attempt's files name (None if none says: an older log), and the
        retries it took to read them."""
        retries = 0
        for name in sorted(names, key=lambda n: not n.startswith("_claim")):
            if not name.endswith(".json"):
                continue
            data, more = self._read(f"{directory}/{name}", f"read {name}")
            retries += more
            try:
                body = json.loads(data) if data is not None else None
            except ValueError:
                continue  # a damaged object says nothing; another of the attempt's may
            if isinstance(body, dict) and "origin" in body:
                return (None if body["origin"] is None else str(body["origin"])), retries
        return None, retries

    def _part(self, header: Mapping[str, Any], payload: memoryview | bytes) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = decode_part(header, payload)
        sink = pa.BufferOutputStream()  # Arrow's own memory: no Python object for Arrow to hold
        pq.write_table(
            table,
            sink,
            compression=self.compression,
            use_dictionary=_DICTIONARY_COLUMNS,
            write_statistics=_STATISTICS_COLUMNS,
        )
        data = sink.getvalue().to_pybytes()
        number = int(header["part"])
        directory = header["directory"]
        name = f"part-{number:08d}-{header['identity']['attempt']}.parquet"
        kept = table.column("kept").to_numpy(zero_copy_only=False)
        seq = table.column("seq").to_numpy()
        manifest = {
            **header["identity"],
            "part": number,
            "file": name,
            "count": table.num_rows,
            "first_seq": int(seq[0]) if seq.size else None,
            "last_seq": int(seq[-1]) if seq.size else None,
            "kept": int(kept.sum()),
            "bytes": len(data),
            # the part's bytes as written: verify_log finds a part changed since (an edited flag
            # or loss, a part swapped for another); not a signature (whoever can write the part
            # can write its manifest)
            "sha256": hashlib.sha256(data).hexdigest(),
            "urls": sorted(v for v in header["url_values"] if v is not None),
            # rows without a shard URL (samples that carried no __url__): replay looks them up
            # under none, also in a part that holds shards' rows
            "no_url": bool(header.get("no_url", False)),
            "created": time.time(),
            # when the part's last record was decided (unix s): a later attempt of the same job
            # that started before it means two processes ran the job at once
            "decided_until": max(header["time"]) if header["time"] else None,
        }
        what = f"write part {number} (records seq {manifest['first_seq']}..{manifest['last_seq']})"
        retries = self._retrying(lambda: self._put(f"{directory}/{name}", data), what)
        reply: dict[str, Any] = {"op": "part", "part": number, "ok": True, "bytes": len(data)}
        try:
            retries += self._retrying(
                lambda: self._put(
                    f"{directory}/_manifest-{number:08d}-{header['identity']['attempt']}.json",
                    self._json(manifest),
                ),
                f"write the manifest of part {number}",
            )
        except OSError as exc:
            # the part is in storage (written whole) with its records: written, its manifest not
            # (found by review, 2026-12-05: the part was counted dropped or unwritten, and verify
            # said its records were not in the log while read_log read them)
            reply["manifest_error"] = str(exc)
        return {**reply, "retries": retries}

    #: Seconds one write is retried before the writer says so on standard error.
    NOTE_AFTER = 5.0

    def _retrying(self, action: Callable[[], None], what: str) -> int:
        """Do ``action``, retrying transient failures for ``retry_timeout`` seconds; a permanent
        one (see ``permanent_cause``) fails at once. Returns the number of retries.

        Past ``NOTE_AFTER`` seconds of retries it says so once on standard error, what and why
        (the trainer notes the claim itself): a full or read-only disk under the log was retried
        for 10 minutes with nothing said, the job looking hung (found by review, 2026-12-06)."""
        start = time.monotonic()
        deadline = start + self.retry_timeout
        delay, retries = 0.2, 0
        while True:
            try:
                action()
                return retries
            except Exception as exc:
                where = redact(self.url, self.secrets)
                cause = permanent_cause(exc)
                waited = time.monotonic() - start
                said = self.noted or what == "write the claim"  # (the trainer notes the claim)
                if cause is None and not said and waited >= self.NOTE_AFTER:
                    self.noted = True
                    print(
                        f"siftpipe: the audit log at {where} could not {what} for {waited:.0f} s "
                        f"({self.safe(exc)}); retrying for up to {self.retry_timeout:g} s "
                        "(retry_timeout), the parts after it queued meanwhile. Check the "
                        "destination (space, permissions, endpoint); said once",
                        file=sys.stderr,
                        flush=True,
                    )
                if cause is not None:
                    raise OSError(
                        f"could not {what} of the audit log at {where}: {cause} ({self.safe(exc)}); "
                        f"not retried, as it will not pass by itself ({retries} retries before it)"
                    ) from None
                if time.monotonic() + delay > deadline:
                    raise OSError(
                        f"could not {what} of the audit log at {where} within "
                        f"{self.retry_timeout:g} s ({retries} retries): {self.safe(exc)}. Check the "
                        f"destination (bucket, permissions, space){DROP_ADVICE}"
                    ) from None
                retries += 1
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
                self._fs = None  # a fresh client after a broken connection

    def _read(self, path: str, what: str) -> tuple[bytes | None, int]:
        """The bytes of ``path`` (None if it is gone), read with retries; and the retries."""
        box: list[bytes | None] = []

        def action() -> None:
            fs = self._filesystem()
            try:
                box.append(fs.cat_file(fs._strip_protocol(path)))
            except FileNotFoundError:
                box.append(None)

        retries = self._retrying(action, what)
        return box[-1], retries

    def _filesystem(self) -> Any:
        if self._fs is None:
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        return self._fs

    def _put(self, path: str, payload: bytes) -> None:
        # whole or not at all; a local leftover of a kill is named so that no reader's glob takes
        # it for a part (DuckDB's **/*.parquet does not skip underscore files)
        fs = self._filesystem()
        put_whole(fs, fs._strip_protocol(path), payload)

    def _json(self, body: Any) -> bytes:
        """``body`` as JSON to store: no string in it holds a credential."""
        return json.dumps(redact_json(body, self.secrets), sort_keys=True).encode()

    def safe(self, exc: BaseException) -> str:
        text = (
            str(exc)
            if isinstance(exc, OSError) and "of the audit log at" in str(exc)
            else (f"{type(exc).__name__}: {exc}")
        )
        return redact(text, self.secrets)


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """The writer process: frames in on ``stdin``, one JSON reply line per frame on ``stdout``.

    The first frame configures the writer. At the end of input (the training process closed the
    pipe, or died) every part that arrived whole has been written.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle, not ours
    first = read_frame(stdin)
    if first is None:
        return 1
    config = first[0]
    writer = PartWriter(**config)
    while (message := read_frame(stdin)) is not None:
        header, payload = message
        if header["op"] == "close":
            break
        reply = writer.handle(header, payload)
        try:
            stdout.write(json.dumps(reply).encode() + b"\n")
            stdout.flush()
        except (BrokenPipeError, ValueError):
            pass  # the trainer is gone; keep writing what arrived
    return 0
