"""Write datasets to WebDataset tar shards at any fsspec URL; a synthetic dataset for demos.

Shards hold no pickle: each field is stored in a plain format chosen by its extension
(``.npy`` arrays, ``.cls`` integer labels, ``.txt`` text, ``.json``), which webdataset's
``.decode()`` and ``decode_sample`` here read back without executing anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..errors import ConfigError, SampleError, ShardError
from .opener import ShardOpener, redact_url

__all__ = [
    "ShardSet",
    "decode_sample",
    "encode_sample",
    "existing_shards",
    "remove_shards",
    "synthetic_arrays",
    "synthetic_classification",
    "write_shards",
]

#: Extensions read back as ints, text and JSON (webdataset's names).
INT_EXTENSIONS = ("cls", "cls2", "index", "inx", "id")
TEXT_EXTENSIONS = ("txt", "text")
JSON_EXTENSIONS = ("json", "jsn")
KNOWN_EXTENSIONS = frozenset(("npy", *INT_EXTENSIONS, *TEXT_EXTENSIONS, *JSON_EXTENSIONS))
DIGITS = 6


@dataclass(frozen=True)
class ShardSet:
    """Shards written by ``write_shards``.

    Attributes:
        urls: Every shard's URL, in order.
        counts: Samples in each shard.
        pattern: The brace pattern naming all of them (``prefix-{000000..000009}.tar``), which
            ``WebDataset``/``ShardSource`` expand.
    """

    urls: list[str]
    counts: list[int]
    pattern: str

    @property
    def samples(self) -> int:
        """Samples written, in all shards."""
        return sum(self.counts)

    def __iter__(self) -> Iterator[str]:
        """The shards' URLs, in order: a ``ShardSet`` is a list of URLs wherever one is taken
        (``WebDataset(shards)``, ``ShardSource(shards)``)."""
        return iter(self.urls)

    def __len__(self) -> int:
        """Shards written."""
        return len(self.urls)


# ---------------------------------------------------------------------------------- encoding


def _field_name(name: str, value: Any) -> str:
    """The field name with an extension: names without one get it from the value's type.

    A name that is itself an extension (``cls``, ``npy``, ``txt``, ``json``, ...) is kept, as
    are the names of bytes values (already encoded: the caller knows their format)."""
    if "." in name or name.lower() in KNOWN_EXTENSIONS or isinstance(value, bytes | bytearray | memoryview):
        return name
    if isinstance(value, bool | np.bool_):
        return f"{name}.cls"
    if isinstance(value, int | np.integer):
        return f"{name}.cls"
    if isinstance(value, str):
        return f"{name}.txt"
    if isinstance(value, dict | list):
        return f"{name}.json"
    return f"{name}.npy"


def _encode_value(key: str, field: str, value: Any) -> bytes:
    ext = field.rsplit(".", 1)[-1].lower()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    try:
        if ext == "npy":
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().numpy()
            buf = io.BytesIO()
            np.save(buf, np.asarray(value), allow_pickle=False)
            return buf.getvalue()
        if ext in INT_EXTENSIONS:
            if isinstance(value, torch.Tensor | np.ndarray):
                value = value.item()
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"{value!r} is not an integer")
            return str(int(value)).encode()
        if ext in TEXT_EXTENSIONS:
            return str(value).encode("utf-8")
        if ext in JSON_EXTENSIONS:
            return json.dumps(value).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"sample {key!r}, field {field!r}: cannot store a {type(value).__name__} as .{ext} "
            f"({exc}); shards hold no pickle: use numeric arrays for .npy, integers for .cls, text "
            "for .txt, JSON-able values for .json, or pass bytes"
        ) from None
    raise ConfigError(
        f"sample {key!r}, field {field!r}: no encoder for .{ext} values of type "
        f"{type(value).__name__}; shards hold no pickle: name the field .npy (arrays, tensors, "
        "numbers), .cls (integer labels), .txt (text) or .json, or pass the encoded bytes"
    )


#: The longest key written, in bytes (UTF-8): far beyond any path, well within the extended
#: header readers take (MAX_EXTENDED_HEADER_BYTES, 1 MiB)
_MAX_KEY_BYTES = 64 * 1024
# member names that readers take for metadata and skip (siftpipe's reader and webdataset's)
_META_MEMBER = re.compile(r"__[^/]*__($|/)")


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone surrogate): what a tar name and a log hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encode_sample(sample: Mapping[str, Any], key: str | None = None) -> tuple[str, dict[str, bytes]]:
    """``(key, {field: bytes})`` of one sample dict, without pickle.

    The key is ``sample["__key__"]`` (or ``key``); other ``__dunder__`` fields are not stored.
    A field's extension chooses its format: ``.npy`` (``np.save``, no pickle; tensors and
    numbers too), ``.cls``/``.index``/``.id`` (an integer as text), ``.txt``, ``.json``; bytes
    are stored as they are. Fields without an extension get one from the value's type
    (int -> ``.cls``, str -> ``.txt``, dict/list -> ``.json``, arrays,
    tensors and floats -> ``.npy``); bytes are stored under their name as given.
    """
    k = sample.get("__key__", key)
    if k is None:
        raise ConfigError("a sample needs a '__key__' (or write_shards numbers the samples for you)")
    k = str(k)
    base = k.rsplit("/", 1)[-1]
    if not base or "." in base:
        raise ConfigError(
            f"sample key {k!r} cannot name tar members: WebDataset splits member names at the first "
            "dot of the base name, so keys must be non-empty and dot-free (use '-' or '_')"
        )
    if not _encodable(k):
        # a lone surrogate: no tar name or log can hold it (readers refuse such a member)
        raise ConfigError(
            f"sample key {k!r} cannot name tar members: it is not valid Unicode text (a lone "
            "surrogate, as from os.fsdecode of bytes that are not UTF-8); decode the name properly"
        )
    if "\0" in k or len(k.encode("utf-8")) > _MAX_KEY_BYTES:
        # a tar name ends at its first NUL (the sample would vanish); a key longer than this
        # makes an extended header readers refuse to take into memory
        raise ConfigError(
            f"sample key {k[:80]!r}{'...' if len(k) > 80 else ''} cannot name tar members: keys hold "
            f"no NUL character and at most {_MAX_KEY_BYTES} bytes"
        )
    fields: dict[str, bytes] = {}
    for name, value in sample.items():
        if name.startswith("__") and name.endswith("__"):
            continue
        if "/" in name or "\0" in name or not _encodable(name):
            # readers split member names at the last '/': k.a/b.txt would be a sample 'k.a/b'
            raise ConfigError(
                f"sample {k!r}, field {name!r}: a field name cannot hold '/', NUL or a lone surrogate "
                "(readers would read the member as another sample, cut its name or refuse it); use "
                "'_' or '-'"
            )
        field = _field_name(name, value)
        if field.lower() in {f.lower() for f in fields}:
            # readers lower-case extensions (as webdataset does): a.TXT and a.txt are one field
            raise ConfigError(f"sample {k!r}: two fields are stored as {field!r}; rename one")
        fields[field] = _encode_value(k, field, value)
    if not fields:
        raise ConfigError(f"sample {k!r} has no fields to store")
    for field in fields:
        if _META_MEMBER.match(f"{k}.{field}"):
            # readers skip such members as metadata (__meta__, __index__/...): it would vanish
            raise ConfigError(
                f"sample {k!r}, field {field!r}: readers skip the member {k}.{field} as metadata "
                "(a name starting __...__/ or __...__, as webdataset skips it); rename the key"
            )
    return k, fields


def decode_sample(sample: Mapping[str, Any], *, to_torch: bool = False) -> dict[str, Any]:
    """Decode a raw shard sample (``bytes`` per field) by extension, never unpickling.

    ``.npy`` -> ``np.ndarray`` (``allow_pickle=False``; a torch tensor with ``to_torch``),
    ``.cls``/``.index``/``.id`` -> int, ``.txt`` -> str, ``.json`` -> its value; other fields
    and ``__key__``/``__url__`` are returned as they are. Matches webdataset's ``.decode()`` for
    these formats, so the same samples decode the same in every adapter. A field that is not valid
    data for its extension raises ``SampleError`` (kind ``corrupt``, ``field`` set; also
    webdataset's ``DecodingError``) naming the sample, the shard and the field.
    """
    out: dict[str, Any] = {}
    for field, value in sample.items():
        if not isinstance(value, bytes | bytearray) or (field.startswith("__") and field.endswith("__")):
            out[field] = value
            continue
        ext = field.rsplit(".", 1)[-1].lower()
        try:
            if ext == "npy":
                array = np.load(io.BytesIO(value), allow_pickle=False)
                out[field] = torch.from_numpy(array) if to_torch else array
            elif ext in INT_EXTENSIONS:
                out[field] = int(value)
            elif ext in TEXT_EXTENSIONS:
                out[field] = bytes(value).decode("utf-8")
            elif ext in JSON_EXTENSIONS:
                out[field] = json.loads(value)
            else:
                out[field] = value
        except (ValueError, UnicodeDecodeError) as exc:
            raise SampleError(
                f"sample {sample.get('__key__')!r} from {redact_url(str(sample.get('__url__')))}: field "
                f"{field!r} is not valid .{ext} data ({exc}); rewrite the shard or decode it yourself",
                url=redact_url(str(sample.get("__url__"))),
                key=sample.get("__key__"),
                kind="corrupt",
                field=field,
            ) from None
    return out


# ---------------------------------------------------------------------------------- writing


def _as_samples(data: Any) -> tuple[Iterable[Mapping[str, Any]], int | None]:
    """Samples and their number (if known) from sample dicts or (x, y) arrays/tensors."""
    if isinstance(data, tuple) and data and all(isinstance(a, np.ndarray | torch.Tensor) for a in data):
        arrays = [a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a for a in data]
        n = len(arrays[0])
        if any(len(a) != n for a in arrays):
            raise ConfigError(f"arrays have different lengths {[len(a) for a in arrays]}; one row per sample")
        names = ["x", "y", *[f"a{i}" for i in range(2, len(arrays))]]
        fields = []
        for name, a in zip(names, arrays):
            integer_labels = a.ndim == 1 and np.issubdtype(a.dtype, np.integer)
            fields.append((f"{name}.cls" if integer_labels else f"{name}.npy", a, integer_labels))

        def rows() -> Iterator[dict[str, Any]]:
            for i in range(n):
                yield {f: (int(a[i]) if lab else a[i]) for f, a, lab in fields}

        return rows(), n
    if isinstance(data, Mapping):
        raise ConfigError("write_shards takes an iterable of sample dicts (or an (x, y) tuple), not one dict")
    try:
        return data, len(data)
    except TypeError:
        return data, None


def _shard_url(prefix: str, index: int) -> str:
    return f"{prefix}-{index:0{DIGITS}d}.tar"


def _tar_bytes(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(mtime)  # as USTAR stored it (a float would add a PAX header per member)
    info.mode = 0o444
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    samples: Iterable[Mapping[str, Any]] | tuple[Any, ...],
    prefix: str,
    *,
    samples_per_shard: int = 1000,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = True,
    total: int | None = None,
    mtime: float = 0.0,
    retries: int = 5,
    existing: Literal["keep", "refuse", "replace"] = "keep",
) -> ShardSet:
    """Write samples to WebDataset tar shards ``{prefix}-000000.tar``, ``-000001.tar``, ...

    Args:
        samples: Sample dicts (see ``encode_sample``; samples without ``__key__`` are numbered
            ``000000000``, ...), or a tuple of arrays/tensors ``(x, y, ...)`` with one row per
            sample (stored as ``x.npy`` and ``y.cls`` for integer labels, else ``y.npy``).
        prefix: Any fsspec URL or local path, without the ``-NNNNNN.tar`` suffix:
            ``s3://bucket/data/train`` writes ``s3://bucket/data/train-000000.tar`` and on.
        samples_per_shard: Samples per shard (the last one may hold fewer).
        storage_options: fsspec options for the URL's filesystem (endpoint_url, key/secret,
            profile, ...); ``None`` uses the standard environment.
        progress: Show a progress bar (samples) on stderr (when tqdm, ``siftpipe[progress]``, is installed).
        total: Number of samples, for the progress bar, when ``samples`` has no ``len``.
        mtime: Modification time stored in the tar headers (seconds since the epoch); the
            default 0 makes the same samples give byte-identical shards.
        retries: Retries of a failed upload (transient errors only), with exponential backoff.
        existing: What to do with shards already at ``prefix`` (``existing_shards``): ``"keep"``
            writes over those it writes and leaves the others (a smaller dataset written over a
            larger one then leaves the larger one's last shards beside it, which a reader of the
            prefix reads mixed with it); ``"refuse"`` raises ``ConfigError`` before writing
            anything; ``"replace"`` removes, once all is written, those it did not write over.
            ``siftpipe shards write`` and ``siftpipe demo --store`` refuse, and replace with
            ``--overwrite``.

    Each shard is written to a local temporary file and then uploaded (or moved) in one piece,
    so a failure never leaves a truncated shard behind. Raises ``ShardError`` naming the shard
    and the fix (missing bucket, no permission, ...) and ``ConfigError`` for a sample that
    cannot be stored without pickle or read back as written: a key with a dot in its base name,
    a field name with ``/``, a member readers skip as metadata (``__name__/...``), or the key of
    the sample just before, a NUL or more than 64 KiB in a key, two fields differing only in
    case. Shards are PAX tar files: keys of any script and length (to 64 KiB).
    """
    from .._optional import progress_bar

    if not isinstance(samples_per_shard, int) or samples_per_shard < 1:
        raise ConfigError(f"samples_per_shard must be a number of samples >= 1, got {samples_per_shard!r}")
    if not isinstance(prefix, str) or not prefix or prefix.endswith(("/", ".tar")):
        raise ConfigError(
            f"prefix must name the shards without their suffix, e.g. 's3://bucket/data/train' for "
            f"train-000000.tar, ..., got {prefix!r}"
        )
    if existing not in ("keep", "refuse", "replace"):
        raise ConfigError(f"existing must be 'keep', 'refuse' or 'replace', got {existing!r}")
    before = existing_shards(prefix, storage_options, retries=retries) if existing != "keep" else []
    if before and existing == "refuse":
        raise ConfigError(
            f"{redact_url(prefix)} already holds {len(before)} shard(s) ({redact_url(before[0])}, ...): "
            "write to another prefix, or replace them (existing='replace'; on the command line "
            "--overwrite), which removes those this write does not replace"
        )
    rows, n = _as_samples(samples)
    opener = ShardOpener(storage_options, retries=retries)
    fs, _ = opener.filesystem(prefix)
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    local = "file" in protocols
    urls: list[str] = []
    counts: list[int] = []
    shown = opener.redact(redact_url(prefix))
    bar = progress_bar(
        total=n if n is not None else total, unit="sample", desc=f"writing {shown}", disable=not progress
    )
    tmpdir = tempfile.mkdtemp(prefix="siftpipe-shard-")
    it = _own_errors(iter(rows))
    # replacing shards: each new one is written beside them under a staged name first and moved
    # into place once every one is written, so that a write interrupted or failing on the way
    # leaves the old dataset whole (found by review, 2026-12-05: each new shard replaced the old
    # one of its number as it was written, and a Ctrl-C left two datasets mixed at the prefix)
    staged = f".partial-{secrets.token_hex(4)}" if before else ""
    written: list[str] = []  # staged shards, to move into place or remove
    try:
        while True:
            url = _shard_url(prefix, len(urls))
            tmp = os.path.join(tmpdir, "shard.tar")
            try:
                if local:  # next to the shard, so that the final rename is atomic
                    path = fs._strip_protocol(url)
                    if os.path.dirname(path):
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                    tmp = f"{path}.partial-{os.getpid()}"
                count = _write_tar(tmp, it, samples_per_shard, sum(counts), mtime, bar)
                if count:
                    _upload(opener, fs, tmp, url + staged, local)
                    if staged:
                        written.append(url + staged)
            except OSError as exc:
                if isinstance(exc, ShardError) or getattr(exc, _FROM_SAMPLES, False):
                    raise  # (the caller's samples failed, not the destination: as it was)
                # the local disk: a folder that cannot be made, no permission, no space
                where = opener.redact(redact_url(url))
                raise ShardError(
                    f"cannot write shard {where}: {exc.strerror or exc} ({exc.filename or tmp}); "
                    "check that the destination folder can be created and written and that its "
                    "disk (and the temporary folder's) has space",
                    url=where,
                    kind="denied" if isinstance(exc, PermissionError) else "other",
                ) from exc
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            if not count:
                break
            urls.append(url)
            counts.append(count)
            if count < samples_per_shard:
                break
    except BaseException:
        # the old dataset is whole: the staged shards go (a Ctrl-C included), best effort
        _remove_quietly(fs, written)
        raise
    finally:
        bar.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if not urls:
        raise ConfigError(f"no samples to write to {shown}: the dataset is empty")
    if written:
        _move_into_place(opener, fs, written, staged, local, shown, len(before))
    # (found by review, 2026-12-05: the commands left them, and a reader read two datasets mixed)
    _remove(
        [u for u in before if u not in set(urls)],
        storage_options,
        lambda cause, left: (
            f"the new shards are written, but {cause}: {left} of the earlier dataset are left beside "
            "the new ones, and a reader of the prefix reads both: delete them, or write to another "
            "prefix"
        ),
    )
    last = len(urls) - 1
    pattern = _shard_url(prefix, 0) if last == 0 else f"{prefix}-{{{0:0{DIGITS}d}..{last:0{DIGITS}d}}}.tar"
    return ShardSet(urls=urls, counts=counts, pattern=pattern)


def existing_shards(
    prefix: str, storage_options: Mapping[str, Any] | None = None, *, retries: int = 5
) -> list[str]:
    """The shards ``write_shards`` would have written at ``prefix`` that are there now
    (``{prefix}-NNNNNN.tar``, in order), as URLs of ``prefix``'s form. A command that writes a
    dataset checks it first: writing over an earlier, larger one leaves its last shards beside
    the new ones, and a reader of the prefix's shards then reads two datasets mixed. ``retries``:
    of a listing that fails for a reason that may pass, as ``write_shards``' own (a failure is a
    ``ShardError`` naming the fix)."""
    opener = ShardOpener(storage_options, retries=retries)
    fs, _ = opener.filesystem(prefix)
    path = fs._strip_protocol(prefix)
    folder, _, name = path.rpartition("/")
    # the folder listed and the names matched exactly, not a glob: a prefix holding [ ] ? or *
    # would be a pattern (found by review, 2026-12-05: exp[1]/train found none of its shards,
    # and t? matched another dataset's)
    shard = re.compile(re.escape(name) + rf"-(\d{{{DIGITS}}})\.tar")

    def listing() -> list[Any]:
        try:
            return list(fs.ls(folder or ("/" if path.startswith("/") else "."), detail=False))
        except (FileNotFoundError, NotADirectoryError):  # no folder yet (or a file in its path:
            return []  # the write that follows says so, naming the shard)

    # retried as a write is, and a failure (no credentials, an endpoint that refuses) a
    # ShardError naming the fix (found by review, 2026-12-05: a raw botocore traceback)
    listed = opener.retrying("listing", prefix, listing)
    numbers = sorted(
        int(m.group(1)) for p in listed if (m := shard.fullmatch(str(p).rstrip("/").rpartition("/")[2]))
    )
    # named as write_shards names them, from their numbers (listed paths lose the URL's form)
    return [_shard_url(prefix, n) for n in numbers]


def remove_shards(urls: Iterable[str], storage_options: Mapping[str, Any] | None = None) -> None:
    """Delete the shards ``urls`` (of one filesystem), as ``existing_shards`` names them; one
    already gone counts as removed. Retried while storage fails in a way that may pass, then a
    ``ShardError`` naming those left (found by review, 2026-12-05: a raw traceback, the old shards
    left beside the new ones unsaid)."""
    _remove(urls, storage_options, lambda cause, left: f"{cause}: {left} are left; delete them")


def _remove(
    urls: Iterable[str], storage_options: Mapping[str, Any] | None, said: Callable[[str, str], str]
) -> None:
    """``remove_shards``, its error's message ``said(cause, "N shard(s) (url, ...)")``."""
    urls = list(urls)
    if not urls:
        return
    opener = ShardOpener(storage_options)
    fs, _ = opener.filesystem(urls[0])
    for i, url in enumerate(urls):

        def remove(path: str = fs._strip_protocol(url)) -> None:
            # already gone (another process, a lifecycle rule): what was asked is done. Until
            # 2026-12-06 an error asked the user to delete the shard that was not there (review)
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)

        try:
            opener.retrying("removing", url, remove)
        except ShardError as exc:  # (the retries' error, naming the shard, the cause, no secret)
            left = [opener.redact(redact_url(u)) for u in urls[i:]]
            shown = f"{len(left)} shard(s) ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''})"
            raise ShardError(said(str(exc), shown), url=left[0], kind=exc.kind) from None


def _span(first: int, last: int) -> str:
    """``shard 2``, or ``shards 0 to 4``."""
    return f"shard {first}" if first == last else f"shards {first} to {last}"


def _remove_quietly(fs: Any, urls: list[str]) -> None:
    """Delete ``urls`` as far as possible, saying nothing (an error is already on its way)."""
    for url in urls:
        try:
            fs.rm_file(fs._strip_protocol(url))
        except Exception:  # (the error that brought us here is the one to see)
            continue


def _move_into_place(
    opener: ShardOpener, fs: Any, staged: list[str], suffix: str, local: bool, shown: str, old: int
) -> None:
    """Move each staged shard (``...tar<suffix>``) over the shard of its name; a failure on the
    way is a ``ShardError`` saying which shards are the new dataset's and which the old one's
    (``old``: how many the prefix held)."""
    for i, url in enumerate(staged):
        source, target = fs._strip_protocol(url), fs._strip_protocol(url[: -len(suffix)])

        def move(source: str = source, target: str = target) -> None:
            if local:
                os.replace(source, target)
            else:
                fs.mv(source, target)

        try:
            opener.retrying("writing", url[: -len(suffix)], move)
        except BaseException as exc:
            _remove_quietly(fs, staged[i:])
            parts = [f"{_span(0, i - 1)} {'holds' if i == 1 else 'hold'} the new dataset"] if i else []
            if i < old:
                parts.append(f"{_span(i, old - 1)} the earlier one")
            missing = len(staged) - i
            parts.append(
                f"the new dataset's {_span(i, len(staged) - 1)} {'is' if missing == 1 else 'are'} not there"
            )
            cause = opener.redact(redact_url(f"{type(exc).__name__}: {exc}"))
            message = (
                f"replacing the shards at {shown} stopped at shard {i} ({cause}): "
                f"{', '.join(parts)}; write again with existing='replace' (--overwrite)"
            )
            if isinstance(exc, Exception):
                raise ShardError(message, url=opener.redact(redact_url(url[: -len(suffix)]))) from None
            exc.add_note(f"siftpipe: {message}")
            raise


#: Set on an error the caller's samples raised (reading an input file, say): handed back as it
#: was, never taken for a failure to write the shard.
_FROM_SAMPLES = "_siftpipe_from_samples"


def _own_errors(it: Iterator[Any]) -> Iterator[Any]:
    """``it``, with what its ``next()`` raises marked as the caller's (``_FROM_SAMPLES``)."""
    while True:
        try:
            sample = next(it)
        except StopIteration:
            return
        except OSError as exc:
            with contextlib.suppress(AttributeError):
                setattr(exc, _FROM_SAMPLES, True)
            raise
        yield sample


def _write_tar(tmp: str, it: Iterator[Any], limit: int, index: int, mtime: float, bar: Any) -> int:
    """Write up to ``limit`` samples from ``it`` into the tar file ``tmp``; how many it wrote."""
    count = 0
    last: str | None = None
    # PAX: the same bytes as USTAR for names of ASCII up to 100 characters, and an extended
    # header for longer or non-ASCII ones (USTAR refused a key of 150 characters with
    # tarfile's bare "name is too long"; found by review, 2026-12-05)
    with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for sample in it:
            if not isinstance(sample, Mapping):
                raise ConfigError(
                    f"sample {index} is a {type(sample).__name__}; write_shards takes sample dicts "
                    "(or an (x, y) tuple of arrays)"
                )
            key, fields = encode_sample(sample, key=f"{index:09d}")
            if key == last:
                # its members would follow the last sample's: readers see one sample with two
                # members per field, and refuse the shard
                raise ConfigError(
                    f"samples {index - 1} and {index} have the same key {key!r}: adjacent samples "
                    "must have different keys (readers group members by key)"
                )
            last = key
            for field, data in fields.items():
                _tar_bytes(tar, f"{key}.{field}", data, mtime)
            count += 1
            index += 1
            bar.update(1)
            if count == limit:
                break
    return count


def _upload(opener: ShardOpener, fs: Any, tmp: str, url: str, local: bool) -> None:
    """Move (local) or upload (remote) a finished shard in one piece."""
    path = fs._strip_protocol(url)
    if local:
        opener.retrying("writing", url, lambda: os.replace(tmp, path))
    else:
        opener.retrying("writing", url, lambda: fs.put_file(tmp, path))


# ---------------------------------------------------------------------------------- synthetic data


def synthetic_arrays(
    n: int,
    *,
    dim: int = 16,
    classes: int = 4,
    hard_fraction: float = 0.1,
    seed: int = 0,
    draw: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x float32 [n, dim], y int64 [n], hard bool [n])`` of a classification task with many
    easy, redundant samples and a hard tail.

    Easy samples sit close to their class centre (a model learns them in a few steps and then
    has nothing left to learn from them); hard samples lie between two class centres with more
    noise, so their loss stays high for long. ``hard_fraction`` of the samples are hard.
    ``seed`` fixes the task (the class centres) and ``draw`` picks independent samples of it:
    draw 0 for training, 1 for a test set, and so on. The same arguments give the same arrays.
    """
    if n < 0 or dim < 2 or classes < 2 or not 0.0 <= hard_fraction <= 1.0:
        raise ConfigError(
            f"need n >= 0, dim >= 2, classes >= 2 and 0 <= hard_fraction <= 1, got n={n}, dim={dim}, "
            f"classes={classes}, hard_fraction={hard_fraction}"
        )
    centres = np.random.default_rng([seed, 0]).normal(size=(classes, dim))
    centres *= 3.0 / np.linalg.norm(centres, axis=1, keepdims=True)
    rng = np.random.default_rng([seed, 1, draw])
    y = rng.integers(0, classes, size=n)
    hard = rng.random(n) < hard_fraction
    x = centres[y] + rng.normal(scale=0.35, size=(n, dim))
    m = int(hard.sum())
    if m:
        other = (y[hard] + rng.integers(1, classes, size=m)) % classes
        t = rng.uniform(0.35, 0.5, size=(m, 1))
        x[hard] = (1 - t) * centres[y[hard]] + t * centres[other] + rng.normal(scale=0.9, size=(m, dim))
    return x.astype(np.float32), y.astype(np.int64), hard


def synthetic_classification(
    n: int,
    *,
    dim: int = 16,
    classes: int = 4,
    hard_fraction: float = 0.1,
    seed: int = 0,
    draw: int = 0,
) -> Iterator[dict[str, Any]]:
    """Sample dicts of ``synthetic_arrays``: ``__key__`` (``000000000``, ...), ``x.npy``
    (float32 [dim]), ``cls`` (label) and ``hard.cls`` (1 for the hard tail, for diagnostics)."""
    x, y, hard = synthetic_arrays(
        n, dim=dim, classes=classes, hard_fraction=hard_fraction, seed=seed, draw=draw
    )
    for i in range(n):
        yield {"__key__": f"{i:09d}", "x.npy": x[i], "cls": int(y[i]), "hard.cls": int(hard[i])}
