"""A group's rows, per-sample or batched, in one place: keys, metadata fields, the weights put on
kept rows, and what a ``PreDecodeFilter`` decided upstream."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import torch

from .._secrets import is_secret_name, redact_url
from ..errors import MissingKeyError
from . import batch as _batch
from .ledger import Group
from .values import scalar_key
from .vocab import PRE_KEPT, PRE_LOSS, PRE_PROB

__all__ = [
    "attach_weights",
    "weight_changes_type",
    "upstream_marked",
    "field_of",
    "keys_of",
    "publish_key",
    "shard_key",
    "upstream_of",
    "weighted_sample",
]


def shard_key(item: Mapping[str, Any]) -> str | list[str]:
    """A key unique across shards: the shard's URL (without credentials: a presigned URL's
    signature is ``***``, so the key is the same however the shard is signed), ``/`` and the
    sample's ``__key__``.

    WebDataset shards number their samples within the shard (often from 0 in each), so
    ``__key__`` alone gives samples of different shards one key, and a score memory, which keeps
    one loss per key, decides them all by the one trained last. Give ``Sifter(key=sp.shard_key)``
    and hand ``observe`` the same keys: ``sifter.observe(sp.shard_key(batch), losses)``.

    Args:
        item: One sample (its ``__url__`` and ``__key__`` strings: returns one key) or a collated
            batch (lists of them, or one URL for the batch: returns a list, one key per row).
    """
    url, key = item["__url__"], item["__key__"]
    if isinstance(key, str):
        return f"{_shown_url(url)}/{key}"
    keys = key_list(key)
    urls = [url] * len(keys) if isinstance(url, str) else list(url)
    if len(urls) != len(keys):
        raise ValueError(
            f"shard_key got {len(urls)} __url__ values for {len(keys)} __key__ values: a batch "
            "must carry one of each per row"
        )
    return [f"{_shown_url(u)}/{k}" for u, k in zip(urls, keys)]


#: Query parameters that sign a URL without being a credential (its date, expiry, scope: S3's and
#: GCS's ``X-...-*``, Azure SAS's, CloudFront's): they change each time the same object is
#: signed, so a key leaves them out, with the credentials ``is_secret_name`` knows
_SIGNING = frozenset(
    {"expires", "se", "st", "sp", "sv", "sr", "spr", "ss", "srt", "si", "skoid", "sktid", "skt",
     "ske", "sks", "skv", "policy", "key-pair-id"}
)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _key_url(url: str) -> str:
    parts = urlsplit(url)
    kept = [
        (name, value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
        if not is_secret_name(name)
        and name.lower() not in _SIGNING
        and not name.lower().startswith(("x-amz-", "x-goog-"))
    ]
    query = urlencode(kept) if kept else ""
    return redact_url(urlunsplit(parts._replace(query=query)))


def _shown_url(url: Any) -> Any:
    """A sample's ``__url__`` as a key holds it: without credentials and without the parameters
    that sign it, so the key is the same however the shard is signed. The key is written to the
    audit log, and webdataset's own reader leaves a presigned URL's signature in ``__url__``
    (found by review, 2026-12-05: in clear in the log's key column; the review of the fix found
    the signing date left in, a new key each signing). Only a URL with a query or a user part is
    changed, once per URL; other query parameters (``versionId``, ``part``) stay."""
    if isinstance(url, str) and ("?" in url or "@" in url):
        return _key_url(url)
    return url


def publish_key(spec: Any) -> dict[str, Any]:
    """How a stage keyed by ``spec`` (its ``key``) finds samples, as a publication for
    ``PreDecodeFilter`` says it: a field's name, ``shard_key``, or neither (a function of its own,
    a tuple's position: ``{"function": None}``, which a filter reads as ``__key__``)."""
    if isinstance(spec, str):
        return {"field": spec}
    return {"function": "shard_key" if spec is shard_key else None}


def key_array(group: Group, batched: bool, spec: Any) -> np.ndarray | None:
    """A batched group's keys as one integer numpy array, when its key field is a 1-d integer
    tensor or array (a map-style dataset's indices); None otherwise (``keys_of`` then)."""
    if not batched or spec is None or callable(spec):
        return None
    try:
        keys = group.items[0][spec]
    except (KeyError, IndexError, TypeError):
        return None
    return integer_keys(keys)


def integer_keys(keys: Any) -> np.ndarray | None:
    """``keys`` as a 1-d integer numpy array if they are an integer tensor or array, or a list of
    Python ints (``tensor.tolist()``: the memory finds an array of them at once, where each key
    of a list is hashed on its own), else None. Only exact ints: ``True`` is another key than 1."""
    if type(keys) is list and keys and type(keys[0]) is int and set(map(type, keys)) == {int}:
        try:
            return np.array(keys, dtype=np.int64)
        except OverflowError:  # beyond 64 bits: hashed one by one, as any other key
            return None
    if isinstance(keys, torch.Tensor):
        if keys.ndim != 1 or keys.dtype == torch.bool or keys.is_floating_point() or keys.is_complex():
            return None
        keys = keys.cpu().numpy()
    if isinstance(keys, np.ndarray) and keys.ndim == 1 and keys.dtype.kind in "iu":
        return keys
    return None


def key_list(keys: Any) -> list[Any]:
    """A batch's key column as a list of its values (a tensor or array gives Python values)."""
    return keys.tolist() if isinstance(keys, torch.Tensor | np.ndarray) else list(keys)


def memory_keys(keys: Any) -> np.ndarray | list[Any]:
    """Keys for the score memory, read as the stage reads a batch's: an integer tensor or array
    stays one integer array, anything else is ``key_list``."""
    as_array = integer_keys(keys)
    return key_list(keys) if as_array is None else as_array


def _named(spec: Any) -> str:
    return f"(key={getattr(spec, '__name__', type(spec).__name__)})" if callable(spec) else repr(spec)


def _per_row(keys: Any, group: Group, spec: Any, purpose: str) -> Any:
    """``keys`` unless it is one value for the whole batch (a string, bytes, a 0-d tensor or
    array), which reading it as a column would split into characters or fail on (found by
    review, 2026-12-05: a batch keyed "abc" logged keys a, b, c)."""
    if isinstance(keys, str | bytes) or getattr(keys, "ndim", None) == 0:
        raise MissingKeyError(
            f"the input batch at sample seq {group.seq0} has one value for the whole batch in "
            f"its key field {_named(spec)} ({type(keys).__name__}), not one key per row; "
            f"{purpose} needs one key per row: collate the samples' keys into a list (as "
            "default_collate does), or pass key=<a callable giving one key per row>"
        )
    return keys


def keys_of(
    group: Group, batched: bool, spec: Any, required: bool = False, purpose: str = "the audit log"
) -> list[Any] | None:
    """The group's keys by ``spec`` (a field, a position or a callable; None: no keys), or None
    when they are missing and not ``required`` (then ``MissingKeyError`` names the fix)."""
    if spec is None:
        return None
    if batched:
        batch = group.items[0]
        if callable(spec):
            # a tensor's values, as a key field's (a list of 0-d tensors: each its value)
            keys = [scalar_key(k) for k in key_list(_per_row(spec(batch), group, spec, purpose))]
        else:
            try:
                keys = batch[spec]
            except (KeyError, IndexError, TypeError):
                if required:
                    raise MissingKeyError(
                        f"the input batch at sample seq {group.seq0} has no key field {spec!r}; "
                        f"{purpose} needs one key per sample: keep '__key__' in the batch, "
                        f"pass key=<field or callable>{_without_keys(purpose)}"
                    ) from None
                return None
            column = _per_row(keys, group, spec, purpose)
            keys = key_list(column)
            if not isinstance(column, torch.Tensor | np.ndarray):
                keys = _tensor_values(keys)  # a list column holding tensors (the review, 2026-12-06)
        if len(keys) != group.rows:
            raise MissingKeyError(
                f"the input batch at sample seq {group.seq0} has {len(keys)} keys in its key "
                f"field {_named(spec)} for its {group.rows} rows; {purpose} needs one key per row"
            )
        return keys
    items = group.items
    try:
        keys = [spec(s) for s in items] if callable(spec) else [s[spec] for s in items]
    except (KeyError, IndexError, TypeError):
        if callable(spec):
            raise
        if not required:
            return None
        for i, sample in enumerate(items):
            try:
                sample[spec]
            except (KeyError, IndexError, TypeError):
                have = list(sample) if isinstance(sample, dict) else type(sample).__name__
                raise MissingKeyError(
                    f"sample seq {group.seq0 + i} has no key field {spec!r} (it has {have}); "
                    f"{purpose} needs one key per sample: keep '__key__' in the sample, "
                    f"pass key=<field, position or callable>{_without_keys(purpose)}"
                ) from None
        raise
    return _tensor_values(keys)


def _tensor_values(keys: list[Any]) -> list[Any]:
    """``keys`` with each tensor or array key as its value (``scalar_key``): a sample's key as a
    0-d tensor (torch.tensor(i)) is its value, as the collated batch's tensor of keys gives it,
    not the text "tensor(5)" (another key, found by nothing). Any row's, not only the first's:
    two datasets mixed, one keyed by text, one by tensor, logged "tensor(1)" where the memory and
    replay used 1 (found by review, 2026-12-06)."""
    if keys and any(issubclass(t, torch.Tensor | np.ndarray) for t in set(map(type, keys))):
        return [scalar_key(k) for k in keys]
    return keys


def _without_keys(purpose: str) -> str:
    """The key=None way out, where there is one: an audit log can do without keys, a score
    memory cannot (it refuses key=None)."""
    return ", or key=None to log without keys" if purpose == "the audit log" else ""


def field_of(group: Group, batched: bool, name: str) -> list[Any] | None:
    """Per-sample values of an optional metadata field (``__url__``, ``__worker__``), or None."""
    if batched:
        batch = group.items[0]
        if isinstance(batch, Mapping) and name in batch:
            values = batch[name]
            return values.tolist() if isinstance(values, torch.Tensor) else list(values)
        return None
    items = group.items
    if isinstance(items[0], Mapping) and name in items[0]:
        return [s.get(name) for s in items]
    return None


def attach_weights(group: Group, batched: bool, field: str | None) -> None:
    """Put each kept row's weight on it: a column of a batch, a field of a dict sample, a last
    element of a tuple (copies: the caller's samples stay as they were)."""
    weight = np.ones(group.rows) if group.weight is None else group.weight
    if batched:
        column = torch.from_numpy(weight.astype(np.float32))
        device = _batch.accelerator_of(group.items[0])
        if device is not None:
            # beside the batch's tensors, so the loss can be weighted there without a copy that
            # waits for the device each step (non_blocking from pageable memory: staged at once)
            column = column.to(device, non_blocking=device.type == "cuda")
        group.items[0] = _batch.with_column(group.items[0], field, column)
        return
    items = group.items
    # float32 values, as a batch's column and the audit log hold them: what a replay of the log
    # hands on is then exactly what this run trained with
    values = weight.astype(np.float32).tolist()
    for i in group.kept_index.tolist():
        items[i] = weighted_sample(items[i], field, values[i])


def weighted_sample(sample: Any, field: str | None, weight: float) -> Any:
    """One sample with its weight, where the stage puts it (and a replay of its log): a copy of a
    mapping with the field ``field`` (a dict; the caller's sample, perhaps reused next epoch,
    stays as it was), a namedtuple's field ``field`` (or a plain tuple, if it has none), a
    tuple's or list's last element (a tuple), else ``(sample, weight)``."""
    if isinstance(sample, Mapping):
        # (any mapping: a UserDict was made a (sample, weight) tuple, and the audit log then
        # found no key in it; found by review, 2026-12-05)
        return {**sample, field: weight}
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):
        return _batch.with_column(sample, field, weight)  # its own field: a namedtuple stays one
    if isinstance(sample, tuple | list):
        return (*sample, weight)
    return (sample, weight)


def weight_changes_type(group: Group, batched: bool, field: str | None) -> str | None:
    """Why ``attach_weights`` would change the type of ``group``'s rows (a namedtuple with no
    field ``field`` becomes a plain tuple), with the fix; ``None`` when it would not."""
    if batched:
        return _batch.lacks_column(group.items[0], field)
    for sample in group.items:
        if isinstance(sample, tuple) and hasattr(sample, "_fields"):
            return _batch.lacks_column(sample, field)
    return None


def upstream_marked(group: Group, batched: bool) -> bool:
    """Whether any of ``group``'s rows carry a ``PreDecodeFilter``'s marks (it marks every row it
    hands on, kept before decode or not)."""
    if batched:
        first = group.items[0]
        return isinstance(first, Mapping) and PRE_KEPT in first
    return any(isinstance(s, Mapping) and PRE_KEPT in s for s in group.items)


def upstream_of(
    group: Group, batched: bool, mixed: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows a ``PreDecodeFilter`` already kept: (mask, their losses, their keep probabilities).
    ``mixed``: samples may come with and without the filter's marks (the stage reaches a filter,
    and any sample may carry them, not only a group's first)."""
    if batched:
        batch = group.items[0]
        # (type() first: isinstance against the Mapping ABC is slow for everything else)
        if not (type(batch) is dict or isinstance(batch, Mapping)) or PRE_KEPT not in batch:
            return None
        columns = [np.asarray(batch[name], dtype=np.float64) for name in (PRE_KEPT, PRE_LOSS, PRE_PROB)]
    else:
        items = group.items
        first = items[0]
        unmarked_first = not (type(first) is dict or isinstance(first, Mapping)) or PRE_KEPT not in first
        if unmarked_first and not (mixed and upstream_marked(group, batched)):
            return None
        # a stream mixing a filter's samples with samples no filter saw: those hold no marks
        # (read as not kept before decode; found by review, 2026-12-05: a KeyError)
        unmarked = {PRE_KEPT: 0.0, PRE_LOSS: float("nan"), PRE_PROB: float("nan")}
        columns = [
            np.fromiter(
                (s.get(name, unmarked[name]) if isinstance(s, Mapping) else unmarked[name] for s in items),
                np.float64,
                len(items),
            )
            for name in (PRE_KEPT, PRE_LOSS, PRE_PROB)
        ]
    mask = columns[0] == 1
    return (mask, columns[1], columns[2]) if mask.any() else None
