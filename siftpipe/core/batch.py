"""Row-wise operations on collated batches (dicts, tuples, lists, tensors, nested)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from ..errors import BatchError, BatchShapeWarning

Batch = Any


def batch_size(batch: Batch) -> int:
    """Number of rows in a collated batch: the first dimension of its first tensor or list."""
    n = _find_size(batch)
    if n is None:
        raise TypeError(
            f"cannot tell the number of samples in a batch of type {type(batch).__name__}: "
            "a batch must hold at least one tensor, array or list with one row per sample"
        )
    return n


def _find_size(batch: Batch, nested: bool = False) -> int | None:
    if type(batch) is dict:
        batch = batch.values()
        for value in batch:
            n = _find_size(value, True)
            if n is not None:
                return n
        return None
    if isinstance(batch, torch.Tensor | np.ndarray):
        return int(batch.shape[0]) if batch.ndim > 0 else None
    if type(batch) is list and not _is_columns(batch, nested):
        return len(batch)  # before the slow isinstance(x, Mapping)
    if isinstance(batch, Mapping):
        for value in batch.values():
            n = _find_size(value, True)
            if n is not None:
                return n
        return None
    if isinstance(batch, tuple):
        for value in batch:
            n = _find_size(value, True)
            if n is not None:
                return n
        return None
    if isinstance(batch, list):
        if _is_columns(batch, nested):
            for value in batch:
                n = _find_size(value, True)
                if n is not None:
                    return n
            return None
        return len(batch)
    return None


class RowList(list):  # type: ignore[type-arg]
    """A batch field's list of one entry per row whose entries are tensors or lists of different
    sizes (detection boxes, token lists, from a collate_fn of one's own): ``rows`` marks such a
    field so that taking, splitting and joining rows never read it as ``default_collate``'s
    columns (a list of tensors that each hold every row). A plain ``list`` otherwise."""

    __slots__ = ()


def rows(batch: Batch, seq: int) -> tuple[Batch, int]:
    """Number of rows in a collated batch, every per-row field checked to hold that many
    (``BatchError`` names the first that does not: rows would be paired with another row's
    key or label, or picked out of range), and the batch with its per-row lists of tensors or
    lists of different sizes marked (``RowList``). ``seq``: the batch's first sample, for the
    message."""
    n = batch_size(batch)
    batch = mark_row_tuples(batch, n)
    wrong = _wrong_rows(batch, n, "")
    if wrong is not None and type(batch) is dict:
        # (only then: a list of tensors not all of n rows is not default_collate's columns). The
        # first field may be such a list, whose first entry's rows were taken for the batch's:
        # the first tensor field's rows are tried too
        for m in (n, *_tensor_rows(batch, n)):
            marked = mark_row_lists(batch, m)
            if marked is not batch and _wrong_rows(marked, m, "") is None:
                batch, n, wrong = marked, m, None
                break
    if wrong is not None and wrong[1] == NOT_COLUMNS:
        how = (
            # (a dict batch's such list of n entries is taken row by row: this one's length is not n)
            "nor one value per sample (its length is not the batch's rows): check the collate_fn"
            if type(batch) is dict
            else "and in a tuple or list batch one value per sample cannot be told from columns: "
            "use a dict batch, or stack the values"
        )
        raise BatchError(
            f"the input batch at sample seq {seq} holds {n} rows, and {wrong[0]} is a list whose "
            f"entries are not columns of them (0-d tensors, numbers or pairs?), {how}"
        )
    if wrong is not None:
        where, got = wrong
        raise BatchError(
            f"the input batch at sample seq {seq} holds {n} rows by its first field but "
            f"{where or 'a field'} has {got}: every per-sample field of a collated batch needs one "
            "entry per sample (a collate_fn that drops or adds rows, or keys collated apart from "
            "their samples?). A field of one tensor (or list) per sample is read as one per row "
            "when their sizes differ, if it is a list in a dict batch (a tuple of them, as "
            "collate_fn=lambda b: tuple(zip(*b)) makes, reads as default_collate's columns: "
            "make the batch a dict of lists); ones of one size are read as columns: stack them, "
            "or hold them in a numpy object array"
        )
    return batch, n


def _tensor_rows(batch: dict[Any, Any], n: int) -> list[int]:
    """The rows of the first tensor (or array) field of ``batch``, if not ``n``."""
    for v in batch.values():
        if isinstance(v, torch.Tensor | np.ndarray) and v.ndim:
            return [int(v.shape[0])] if int(v.shape[0]) != n else []
    return []


def mark_row_lists(batch: dict[Any, Any], n: int) -> dict[Any, Any]:
    """``batch`` with each field that is a list of ``n`` values not all columns of ``n`` rows
    (``_is_column``: so not default_collate's) as a ``RowList``; the same dict if there is none."""
    out = None
    for k, v in batch.items():
        if (
            type(v) is list
            and len(v) == n
            and n
            and isinstance(v[0], torch.Tensor | np.ndarray | list | tuple)
        ):
            if not all(_is_column(e, n) for e in v):
                if out is None:
                    out = dict(batch)
                out[k] = RowList(v)
        elif type(v) is dict:
            marked = mark_row_lists(v, n)
            if marked is not v:
                if out is None:
                    out = dict(batch)
                out[k] = marked
    return batch if out is None else out


#: ``_wrong_rows``' count for a list whose entries are not columns (0-d tensors, scalars, pairs)
NOT_COLUMNS = -1


def _is_column(value: Any, n: int) -> bool:
    """Whether ``value`` holds ``n`` rows as default_collate builds a column: a tensor or array of
    ``n`` rows, ``n`` scalars (strings collated), or a sequence or mapping of such columns."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return bool(value.ndim) and int(value.shape[0]) == n
    if isinstance(value, list | tuple):
        if not value:
            return False
        if len(value) == n and not any(isinstance(v, _NESTED) for v in value):
            return True
        return all(_is_column(v, n) for v in value)
    if isinstance(value, Mapping):
        return bool(value) and all(_is_column(v, n) for v in value.values())
    return False


_NESTED = (torch.Tensor, np.ndarray, list, tuple, Mapping)


def _scalar_tuple(value: Any) -> bool:
    """A tuple of one entry per row: a ``RowTuple`` (``rows`` marks those), or a plain tuple of
    strings, what default_collate makes of a string field inside a sequence (``("b0", "b1",
    ...)``; until 2026-12-05 its entries were read as columns and never cut). Not an unmarked
    tuple of numbers: default_collate makes tensors of those, and webdataset's collation keeps
    each sample's own ``(h, w)`` pair as it was, inside a list."""
    if type(value) is RowTuple:
        return True
    return type(value) is tuple and bool(value) and isinstance(value[0], str | bytes)


class RowTuple(tuple):  # type: ignore[type-arg]
    """A batch field's (or a tuple batch's entry's) plain tuple of single values (numbers,
    ``None``, strings, 0-d tensors, dicts), one per row: what a collate_fn built on
    ``zip(*samples)`` makes of ids, lengths or per-sample targets. ``rows`` marks such a tuple so
    that taking, splitting and joining rows cut it as they cut a list (until 2026-12-05 it was
    read as columns and handed on uncut, every row's value beside the kept rows; found by
    review). A plain ``tuple`` otherwise."""

    __slots__ = ()


def _single_values(value: Any) -> bool:
    """A plain tuple (not a named one) none of whose entries holds rows: no list, tuple, or
    tensor or array of one dimension or more."""
    return (
        type(value) is tuple
        and bool(value)
        and not any(
            isinstance(v, list | tuple) or (isinstance(v, torch.Tensor | np.ndarray) and v.ndim)
            for v in value
        )
    )


def _row_pairs(value: tuple[Any, ...]) -> bool:
    """Plain tuples of single values: one row's own tuple each (a ``zip(*samples)`` collate's
    ``(h, w)`` pairs). Of as many entries each as rows they may be columns too (a tuple of
    per-row tuples, one per field): read as rows all the same, as the same field is in batches
    of other sizes, and warned about (the review of the first version, which read them as
    columns: an epoch's short last batch of 2 rows, joined by ``output_batch`` with others,
    misaligned their rows)."""
    return all(type(v) is tuple and _single_values(v) for v in value)


#: Types ``mark_row_tuples`` need not look into (the common fields, skipped at once)
_LEAVES = frozenset({torch.Tensor, np.ndarray, list, str, bytes, int, float, type(None)})


def mark_row_tuples(batch: Batch, n: int) -> Batch:
    """``batch`` with each plain tuple of ``n`` single values (or of ``n`` plain tuples of single
    values: ``(h, w)`` pairs, see ``_row_pairs``) inside its mappings and tuples, named ones too,
    at any depth, as a ``RowTuple``; the same object if there is none. (Not the batch itself, and
    not inside lists: there a tuple is a row's own value, webdataset's ``(h, w)``, or a column.
    Not a tuple of another length: a value for the whole batch, ``(224, 224)``, handed on whole
    as before; the review of the first version, which read it per row. Until 2026-12-06 only a
    mapping's fields and a plain tuple batch's entries were looked at, and tuples of pairs not at
    all: a namedtuple batch's ids, a ``(x, {"ids": ...})`` batch's, and a field of ``(h, w)``
    pairs were handed on whole beside the kept rows; found by review.)"""

    def row_tuple(value: Any) -> bool:
        return type(value) is tuple and len(value) == n and (_single_values(value) or _row_pairs(value))

    def mark(value: Any, top: bool = False, path: tuple[Any, ...] = ()) -> Any:
        if not top and row_tuple(value):
            if n > 1 and all(type(v) is tuple and len(v) == n for v in value):
                _warn_square_tuple(path, n)
            return RowTuple(value)
        if isinstance(value, Mapping):
            out = None
            for k, v in value.items():
                if type(v) in _LEAVES:
                    continue
                marked = mark(v, path=(*path, k))
                if marked is not v:
                    if out is None:
                        out = dict(value)
                    out[k] = marked
            return value if out is None else like(value, out)
        if type(value) is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
            # (not another tuple subclass, torch.Size say, which a rebuild may not fit)
            parts = [v if type(v) in _LEAVES else mark(v, path=(*path, i)) for i, v in enumerate(value)]
            if all(p is v for p, v in zip(parts, value)):
                return value
            if hasattr(value, "_fields"):  # a namedtuple (_make: one with its own __new__ too)
                make = getattr(type(value), "_make", None)
                return make(parts) if make is not None else type(value)(*parts)
            return tuple(parts)
        return value

    return mark(batch, top=True)


def _warn_square_tuple(path: tuple[Any, ...], n: int) -> None:
    """A tuple of ``n`` tuples of ``n`` entries each, in a batch of ``n`` rows: one tuple per row
    or per field, the shapes cannot tell (a batch of as many rows as a row's pair has entries: an
    epoch's short last batch, say). Read per row, as such tuples are in batches of other sizes."""
    shown = "".join(f"[{p!r}]" for p in path)
    warnings.warn(
        f"siftpipe: the batch field {shown} is a tuple of {n} tuples of {n} entries each, in a "
        f"batch of {n} rows: it is read as one tuple per sample ((h, w) pairs from a "
        "zip(*samples) collate), cut to the kept rows. If it holds one tuple per field (columns) "
        "instead, the rows would be cut wrongly: make it a dict of those tuples",
        BatchShapeWarning,
        stacklevel=3,
    )


def _all_of_length(values: list[Any], n: int) -> bool:
    """Whether every entry holds ``n`` rows (a 0-d tensor holds none)."""
    try:
        return all(len(v) == n for v in values)
    except TypeError:
        return False


def _wrong_rows(batch: Batch, n: int, path: str, nested: bool = False) -> tuple[str, int] | None:
    """The first per-row field of ``batch`` (its path) whose row count is not ``n``, and that count."""
    if type(batch) is list and not _is_columns(batch, nested):
        # a field of one entry per row (keys, urls): before the slow isinstance(x, Mapping)
        return (path, len(batch)) if len(batch) != n else None
    if type(batch) is dict or isinstance(batch, Mapping):
        for k, v in batch.items():
            found = _wrong_rows(v, n, f"{path}[{k!r}]" if path else repr(k), True)
            if found is not None:
                return found
        return None
    if isinstance(batch, torch.Tensor | np.ndarray):
        if batch.ndim and batch.shape[0] != n:
            return path, int(batch.shape[0])
        return None
    if nested and _scalar_tuple(batch):
        # default_collate's column of strings (a str field inside a sequence): one per row
        return (path, len(batch)) if len(batch) != n else None
    if isinstance(batch, tuple) or (isinstance(batch, list) and _is_columns(batch, nested)):
        for i, v in enumerate(batch):
            found = _wrong_rows(v, n, f"{path}[{i}]" if path else f"position {i}", True)
            if found is not None:
                return found
        if nested and type(batch) is list:
            if not _is_column(batch, n):
                # default_collate's columns hold every row down to their leaves: a list of 0-d
                # tensors, of pairs (h, w) or of numbers is one entry per sample, and handed on
                # uncut it would misalign its samples (found by review, 2026-12-05)
                return path, NOT_COLUMNS
            if len(batch) == n > 1 and _all_of_length(batch, n):
                _warn_square(path, n)
        return None
    if isinstance(batch, list) and len(batch) != n:
        return path, len(batch)
    return None


def _is_columns(batch: list[Any], nested: bool = False) -> bool:
    """A list from collating tuple samples holds one column per field, not one row per sample.
    ``nested``: the list is a field of the batch, not the batch: a list of dicts there holds one
    dict per sample (WebDataset's collation of a ``json`` field, detection labels), where the
    batch itself, collated from (dict, ...) tuples, holds a dict of columns first."""
    if not batch or type(batch) is RowList:
        return False
    first = batch[0]
    return isinstance(first, torch.Tensor | np.ndarray | tuple | list) or (
        not nested and isinstance(first, Mapping)
    )


def _warn_square(path: str, n: int) -> None:
    """A field that is a list of ``n`` values of ``n`` rows each, in a batch of ``n`` rows: columns
    or one value per sample, the shapes cannot tell (said once per field and place)."""
    warnings.warn(
        f"siftpipe: the batch field {path} is a list of {n} tensors (or lists) of {n} rows each, "
        f"in a batch of {n} rows: it is read as default_collate's columns (a tuple field), each "
        "cut to the kept rows. If it holds one value per sample instead (boxes, token lists), "
        "they would be cut wrongly: stack them, or hold them in a numpy object array. A tuple "
        "field as long as the batch is read right: filter this warning then "
        "(warnings.filterwarnings('ignore', category=siftpipe.BatchShapeWarning))",
        BatchShapeWarning,
        stacklevel=2,
    )


def like(batch: Mapping[str, Any], items: dict[str, Any]) -> Mapping[str, Any]:
    """``items`` in ``batch``'s mapping type (a Hugging Face ``BatchEncoding``, a ``UserDict``):
    rows taken from, split off, joined to or added to a batch are handed on as the batch was
    (found by review, 2026-12-05: a ``BatchEncoding`` came out a plain dict whenever a row was
    dropped, and a loop calling ``batch.to(device)`` failed on the second batch). A type that
    cannot be made from a dict of its fields is handed on as a dict. (Not a copy of the batch
    with its fields set: a shallow copy may share the original's storage, and setting its fields
    would change the batch the caller holds.)"""
    kind = type(batch)
    if kind is dict or _REBUILD.get(kind) is False:
        return items
    try:
        out = kind(items)  # type: ignore[call-arg]
        # the same fields holding the very values given (not converted by the type)
        if (
            isinstance(out, Mapping)
            and list(out.keys()) == list(items)
            and all(out[k] is v for k, v in items.items())
        ):
            _REBUILD[kind] = True
            return out
    except Exception:
        pass
    _REBUILD[kind] = False
    return items


#: Whether ``like`` can make a mapping type from a dict of its fields.
_REBUILD: dict[type, bool] = {}


def take(batch: Batch, index: np.ndarray) -> Batch:
    """Rows ``index`` (int64 positions, in order) of ``batch``, in the same structure."""
    return _take(batch, index, None)


def _take(batch: Batch, index: np.ndarray, tindex: torch.Tensor | None, nested: bool = False) -> Batch:
    if type(batch) is dict:  # the common case first: isinstance(x, Mapping) is slow
        if tindex is None:
            tindex = torch.from_numpy(index)
        try:
            return {k: _take(v, index, tindex, True) for k, v in batch.items()}
        except BatchError as exc:
            raise _named(batch, exc) from None
    if isinstance(batch, torch.Tensor):
        if batch.ndim == 0:
            return batch
        if tindex is None or tindex.device != batch.device:
            # from pageable memory, non_blocking stages the index at once and queues the copy
            # without waiting for the device (a blocking copy would wait for its queued work)
            tindex = torch.from_numpy(index).to(batch.device, non_blocking=batch.is_cuda)
        if batch.layout is not torch.strided:
            return _sparse_rows(batch, tindex)
        return batch.index_select(0, tindex)
    if isinstance(batch, np.ndarray):
        return batch[index] if batch.ndim else batch
    if type(batch) is list and not _is_columns(batch, nested):
        return _take_rows(batch, index)  # before the slow isinstance(x, Mapping)
    if isinstance(batch, Mapping):
        if tindex is None:
            tindex = torch.from_numpy(index)
        return like(batch, {k: _take(v, index, tindex, True) for k, v in batch.items()})
    if nested and _scalar_tuple(batch):
        taken = _take_rows(batch, index)  # (strings collated, or marked: one per row)
        return RowTuple(taken) if type(batch) is RowTuple else tuple(taken)
    if isinstance(batch, tuple) or (isinstance(batch, list) and _is_columns(batch, nested)):
        if tindex is None:
            tindex = torch.from_numpy(index)
        parts = [_take(v, index, tindex, True) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if isinstance(batch, list):
        taken = _take_rows(batch, index)
        return RowList(taken) if type(batch) is RowList else taken
    return batch


def _named(batch: Mapping[str, Any], exc: BatchError) -> BatchError:
    """``exc`` (a sparse field's) naming the field, when one of ``batch``'s holds such a tensor."""
    said = str(exc)
    for name, value in batch.items():
        # the field whose layout and shape the error names (not merely the first sparse one)
        if (
            isinstance(value, torch.Tensor)
            and value.layout is not torch.strided
            and f"a {value.layout} tensor of shape {list(value.shape)}" in said
        ):
            return BatchError(said.replace("a batch field holds", f"batch field {name!r} holds", 1))
    return exc


def _sparse_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of a sparse tensor (COO allows it), or the error naming the fix."""
    try:
        taken = tensor.index_select(0, rows)
    except (NotImplementedError, RuntimeError):
        raise _sparse(tensor) from None
    # coalesced as it came (index_select leaves it uncoalesced, and a training step reading
    # indices() then fails; found by review, 2026-12-05)
    return taken.coalesce() if tensor.layout is torch.sparse_coo and tensor.is_coalesced() else taken


def _sparse(tensor: torch.Tensor) -> BatchError:
    """The error for a batch field holding a sparse tensor, whose rows cannot be taken (found by
    review, 2026-12-05: torch's own NotImplementedError, naming no field and no fix)."""
    return BatchError(
        f"a batch field holds a {tensor.layout} tensor of shape {list(tensor.shape)}: the stage "
        "takes the kept rows of a batch by indexing its tensors, which this layout does not allow. "
        "Make it dense where the batch is collated (.to_dense()), or hold one tensor per row in a "
        "list (rows of a list are taken as they are)"
    )


def _take_rows(rows: list[Any], index: np.ndarray) -> list[Any]:
    """Entries ``index`` of a list holding one entry per row."""
    if index.size == 0:
        return []
    picked = itemgetter(*index.tolist())(rows)
    return list(picked) if index.size > 1 else [picked]


def split(batch: Batch, size: int, nested: bool = False) -> tuple[Batch, Batch]:
    """The first ``size`` rows of ``batch`` and the rest, in the same structure, as slices:
    tensors and arrays share ``batch``'s memory (no copy), lists are new lists."""
    if isinstance(batch, Mapping):
        try:
            parts = {k: split(v, size, True) for k, v in batch.items()}
        except BatchError as exc:
            raise _named(batch, exc) from None
        return like(batch, {k: v[0] for k, v in parts.items()}), like(
            batch, {k: v[1] for k, v in parts.items()}
        )
    if isinstance(batch, torch.Tensor | np.ndarray):
        if isinstance(batch, torch.Tensor) and batch.layout is not torch.strided and batch.ndim:
            rows = torch.arange(batch.shape[0], device=batch.device)
            return _sparse_rows(batch, rows[:size]), _sparse_rows(batch, rows[size:])
        return (batch[:size], batch[size:]) if batch.ndim else (batch, batch)
    if nested and _scalar_tuple(batch):
        if type(batch) is RowTuple:
            return RowTuple(batch[:size]), RowTuple(batch[size:])
        return batch[:size], batch[size:]
    if isinstance(batch, tuple) or (isinstance(batch, list) and _is_columns(batch, nested)):
        pairs = [split(v, size, True) for v in batch]
        heads, tails = [p[0] for p in pairs], [p[1] for p in pairs]
        if hasattr(batch, "_fields"):
            return type(batch)(*heads), type(batch)(*tails)
        return type(batch)(heads), type(batch)(tails)
    if type(batch) is RowList:
        return RowList(batch[:size]), RowList(batch[size:])
    if isinstance(batch, list):
        return batch[:size], batch[size:]
    return batch, batch


def concat(batches: Sequence[Batch], nested: bool = False) -> Batch:
    """Concatenate batches of the same structure along rows; ``BatchError`` naming the field
    where they differ (a field missing from one, another shape past the rows)."""
    try:
        return _concat(batches, nested)
    except (RuntimeError, KeyError, IndexError, TypeError, ValueError) as exc:
        where = _mismatch(batches, "")
        if where is None:
            raise  # not the batches' shapes (out of memory, say): the error as it came
        raise BatchError(
            f"the kept rows of {len(batches)} input batches cannot be joined into one output batch: "
            f"{where}. Every input batch must hold the same fields, each of one shape past its rows "
            "(a collate_fn that pads to each batch's longest? pad to one length), or pass "
            "output_batch=None to hand on each input batch's kept rows as they are"
        ) from exc


def _mismatch(batches: Sequence[Batch], path: str) -> str | None:
    """Where ``batches`` first differ in structure, said (None: nowhere found)."""
    first = batches[0]
    shown = path or "the batch"
    for i, b in enumerate(batches[1:], 1):
        if {type(b), type(first)} == {RowTuple, tuple}:
            return (
                f"{shown} is read as one entry per row in one input batch and as one tuple per "
                "field (columns) in another (a BatchShapeWarning names such a batch): hold it in "
                "a numpy array or tensor of one row per sample"
            )
        if type(b) is not type(first) and not (isinstance(b, Mapping) and isinstance(first, Mapping)):
            return f"{shown} is a {type(first).__name__} in one input batch, a {type(b).__name__} in another"
        if isinstance(first, torch.Tensor | np.ndarray):
            if first.shape[1:] != b.shape[1:]:
                return (
                    f"{shown} holds {tuple(first.shape)} {first.dtype} in one input batch and "
                    f"{tuple(b.shape)} {b.dtype} in another"
                )
        elif isinstance(first, Mapping) and set(first) != set(b):
            missing = sorted(map(str, set(first) ^ set(b)))
            return f"field(s) {missing} of one input batch are missing from another (batch {i})"
    if isinstance(first, Mapping):
        for k in first:
            found = _mismatch([b[k] for b in batches], f"{path}[{k!r}]" if path else repr(k))
            if found:
                return found
    elif bool(path) and _scalar_tuple(first):
        return None  # one string per row: any count joins
    elif isinstance(first, tuple | list) and all(len(b) == len(first) for b in batches):
        if isinstance(first, tuple) or _is_columns(first, bool(path)):
            for j in range(len(first)):
                found = _mismatch([b[j] for b in batches], f"{path}[{j}]" if path else f"position {j}")
                if found:
                    return found
    elif isinstance(first, tuple):
        return f"{shown} has {len(first)} entries in one input batch and another count in another"
    return None


def _concat(batches: Sequence[Batch], nested: bool = False) -> Batch:
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if not first.ndim:
            return first
        joined = torch.cat(list(batches))
        if first.layout is torch.sparse_coo and all(b.is_coalesced() for b in batches):
            joined = joined.coalesce()  # (as _sparse_rows)
        return joined
    if isinstance(first, np.ndarray):
        return np.concatenate(list(batches)) if first.ndim else first
    if isinstance(first, Mapping):
        return like(first, {k: _concat([b[k] for b in batches], True) for k in first})
    if (type(first) is RowTuple or type(first) is tuple) and any(
        (type(b) is RowTuple) is not (type(first) is RowTuple) for b in batches
    ):
        # read per row in some batches and as columns in others: joined, rows would misalign
        # (the review of the square reading, 2026-12-06); concat names the field
        raise TypeError("a tuple read per row in one input batch and as columns in another")
    if nested and _scalar_tuple(first):
        entries = tuple(x for b in batches for x in b)
        return RowTuple(entries) if type(first) is RowTuple else entries
    if isinstance(first, tuple) or (
        isinstance(first, list) and _is_columns(first, nested) and not _rows_of_one_among_rows(batches)
    ):
        parts = [_concat([b[i] for b in batches], True) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    if isinstance(first, list):
        out: list[Any] = RowList() if any(type(b) is RowList for b in batches) else []
        for b in batches:
            out.extend(b)
        return out
    return first


def _rows_of_one_among_rows(batches: Sequence[Any]) -> bool:
    """Whether a field's lists are one entry per row in some input batches (``RowList``) and, in
    the others, one entry of one row each: a batch of one row whose entry has one element reads
    as ``default_collate``'s column, which is the same there, and joined with the per-row ones it
    is one row of theirs (found by review, 2026-12-05: batch size 1, the columns' reading of the
    first batch concatenated the rows' token tensors into one)."""
    if not any(type(b) is RowList for b in batches):
        return False
    return all(
        type(b) is RowList or (len(b) == 1 and getattr(b[0], "shape", (None,))[:1] == (1,)) for b in batches
    )


def pad_rows(batch: Batch, size: int) -> Batch:
    """Pad ``batch`` to ``size`` rows by repeating its last row (padding is never emitted)."""
    n = batch_size(batch)
    if n >= size:
        return batch
    index = np.concatenate([np.arange(n), np.full(size - n, n - 1)]).astype(np.int64)
    return take(batch, index)


def accelerator_of(batch: Batch) -> torch.device | None:
    """The device of the first tensor of ``batch`` that is not on the CPU (``None``: none is)."""
    if isinstance(batch, torch.Tensor):
        return None if batch.device.type == "cpu" else batch.device
    if isinstance(batch, Mapping):
        parts: Any = batch.values()
    elif isinstance(batch, tuple | list):
        parts = batch
    else:
        return None
    for value in parts:
        if isinstance(value, torch.Tensor | Mapping | tuple) or (
            isinstance(value, list) and value and isinstance(value[0], torch.Tensor)
        ):
            device = accelerator_of(value)
            if device is not None:
                return device
    return None


def with_column(batch: Batch, name: str | None, column: Any) -> Batch:
    """Add a per-row column (or one sample's value): a dict field ``name``, the field ``name`` of
    a namedtuple that has one, or a last element of a tuple/list (a namedtuple without the field
    becomes a plain tuple then: ``lacks_column``)."""
    if isinstance(batch, Mapping):
        out = dict(batch)
        out[name] = column
        return like(batch, out)
    if isinstance(batch, tuple):
        if name in getattr(batch, "_fields", ()):  # a namedtuple with the field: it stays one
            replace: Callable[..., Batch] = getattr(batch, "_replace")  # noqa: B009 (a namedtuple's)
            return replace(**{str(name): column})
        return (*batch, column)
    if isinstance(batch, list):
        return [*batch, column]
    return (batch, column)


def lacks_column(batch: Batch, name: str | None) -> str | None:
    """What ``with_column(batch, name, ...)`` makes of a namedtuple with no field ``name`` (a
    plain tuple, whose fields the training step can no longer read as attributes), said with the
    fix; ``None`` for anything else."""
    fields = getattr(batch, "_fields", None)
    if not (isinstance(batch, tuple) and fields is not None and name not in fields):
        return None
    kind = type(batch).__name__
    return (
        f"the policy attaches a weight to each kept sample, and a {kind} (a namedtuple with fields "
        f"{', '.join(fields)}) has no field {name!r} to hold it: it is handed on as a plain tuple "
        f"with the weight appended, ({', '.join(fields)}, weight), on which attribute access "
        f"(.{fields[0]}) fails. To keep the {kind}, give it a field for the weight and name it: "
        f"namedtuple({kind!r}, [{', '.join(repr(f) for f in fields)}, 'weight'], defaults=[1.0]) "
        "with Sifter(..., weight_field='weight')"
    )


def to_device(batch: Batch, device: torch.device, non_blocking: bool) -> Batch:
    """Move every tensor of ``batch`` to ``device`` (``non_blocking`` only from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking and batch.is_pinned())
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple):
        parts = [to_device(v, device, non_blocking) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if isinstance(batch, list) and batch and isinstance(batch[0], torch.Tensor):
        return [to_device(v, device, non_blocking) for v in batch]
    return batch


def pin(batch: Batch) -> Batch:
    """Page-lock every CPU tensor of ``batch`` so the copy to an accelerator can overlap."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory() if batch.device.type == "cpu" else batch
    if isinstance(batch, Mapping):
        return {k: pin(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        parts = [pin(v) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def field(batch: Batch, name: str | int) -> Any:
    """``batch[name]`` with an error that lists the fields there are."""
    try:
        return batch[name]
    except (KeyError, IndexError, TypeError):
        if isinstance(batch, Mapping):
            have = ", ".join(repr(k) for k in batch)
        elif isinstance(batch, Sequence):
            have = f"positions 0..{len(batch) - 1}"
        else:
            have = f"a {type(batch).__name__}, not indexable"
        raise KeyError(f"batch has no field {name!r} (it has {have})") from None


Collate = Callable[[list[Any]], Batch]
