"""Resuming inside a pass: re-reading the groups a checkpoint decided and had not handed on (never
re-scored), and checking that the source is where the checkpoint left it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ResumeError
from . import batch as _batch
from .ledger import TAIL, Group, Ledger
from .rows import attach_weights, field_of, keys_of
from .source import END, Raised, Reader
from .values import plain_keys
from .vocab import PRE_KEPT

#: Said of a source whose items a ``PreDecodeFilter`` decided: what reaches the stage depends on
#: the publication the workers read, not only on the order
_PUBLISHED = (
    "; its items passed a PreDecodeFilter, which decides from the newest publication: one "
    "published after the checkpoint changes which samples come (resume before publishing again)"
)


def _where(state: Mapping[str, Any], item: Any) -> str:
    """What a resume refused for the source's position says to do (``item``: what it gave)."""
    return (
        f"feed the source from item {state['consumed']} (state['consumed']) in the same order: "
        "every shuffle before the stage seeded (a WebDataset's shardshuffle and .shuffle() with "
        "seed=, a DataLoader's generator=), the same shards, workers and batch sizes. "
        "webdataset's detshuffle=True reseeds with an epoch it counts in the process itself: a "
        "new process resuming a later epoch starts it at 0 (make the dataset each epoch with "
        "seed=base + epoch, in the first run too)"
        f"{_published(item)}"
    )


def _published(item: Any) -> str:
    """``_PUBLISHED`` if ``item`` (a sample or a collated batch) passed a ``PreDecodeFilter``."""
    return _PUBLISHED if isinstance(item, Mapping) and PRE_KEPT in item else ""


__all__ = [
    "check_next",
    "check_tail",
    "first_key",
    "first_shard",
    "note_keys",
    "note_tail",
    "reread_groups",
    "shard_name",
    "shard_names",
    "tail_entry",
]


def reread_groups(
    reader: Reader,
    state: Mapping[str, Any],
    ledger: Ledger,
    batched: bool,
    key: Any,
    weight_field: str | None,
    snapshot: Callable[[], Any] | None = None,
) -> list[Group]:
    """Re-read from ``reader`` the groups the checkpoint ``state`` decided and had not handed on,
    with their decisions, into ``ledger``; ``ResumeError`` if the source does not give them.
    ``weight_field``: put the decided weights on kept rows there (None: do not attach them).
    ``snapshot``: the tracked source's state now (None: not tracked), kept with each re-read
    group as ``Sifter`` keeps it with each group it reads, so that a state taken while a re-read
    group is still pending restores the source to that group's start."""
    groups: list[Group] = []
    emitted = int(state["emitted"])
    for desc in state["pending"]:
        if not groups:
            before = state.get("source")  # the checkpoint's: its source before this group
        elif snapshot is None:
            before = None
            reader.snapshot_taken()
        else:
            reader.iterate()
            if reader.has_ahead:
                before = reader.ahead_snapshot
            else:
                before = snapshot()
                reader.snapshot_taken()
        items = reader.take(desc["n_items"])
        if len(items) < desc["n_items"]:
            reader.raise_held()  # the source failed partway through the group: its own error
        if batched and len(items) == 1:
            # re-read as first read: the same row check, the same per-row lists and tuples marked
            # (RowList, RowTuple; found by review, 2026-12-05: a UserDict's or a tuple batch's
            # tuple of ids came out uncut after a resume, a BatchEncoding's failed to join)
            items = [_batch.rows(items[0], int(desc["seq0"]))[0]]
        group = Group(items, desc["rows"], desc["seq0"], before)
        if reader.skipped:
            group.skipped = tuple(reader.skipped)
        if ledger.tail is not None:
            note_tail(group, batched, key)
        elif key is not None:
            note_keys(group, batched, key)
        # a tracked source was put back where the checkpoint left it by the stage: feeding it
        # from an item is not the fix there (found by review, 2026-12-06)
        fix = (
            "feed the loader whole, built as when the checkpoint was taken (its batch size, "
            "collate_fn, dataset and sampler)"
            if snapshot is not None
            else f"feed it from item {state['consumed']}"
        )
        if len(items) < desc["n_items"]:
            raise ResumeError(
                f"resuming needs the {desc['n_items']} input item(s) decided before the "
                f"checkpoint (sample seq {desc['seq0']}..), but the source ended after "
                f"{len(items)}; {fix}"
            )
        if batched and _batch.batch_size(items[0]) != desc["rows"]:
            raise ResumeError(
                f"resuming needs the input batch decided before the checkpoint (sample seq "
                f"{desc['seq0']}..) of {desc['rows']} rows, but the source gave one of "
                f"{_batch.batch_size(items[0])}: its batch size or collate_fn changed, or it is fed "
                f"from elsewhere; {fix}"
            )
        if desc["keys"] is not None and key is not None:
            got = keys_of(group, batched, key)
            if got is None:
                raise ResumeError(
                    f"the checkpoint names the samples to re-read by key, but the source's "
                    f"item(s) at item {state['consumed']} have no key {key!r}; feed the "
                    "source the checkpoint was taken from, from item state['consumed']"
                )
            if got != desc["keys"]:
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, desc["keys"], strict=False)) if a != b),
                    min(len(got), len(desc["keys"])) - 1,
                )
                raise ResumeError(
                    f"the source is not where the checkpoint left it: sample {first} of the "
                    f"in-flight micro-batch has key {got[first]!r}, the checkpoint "
                    f"expected {desc['keys'][first]!r}; {_where(state, items[0])}"
                )
        want = desc.get("shards")  # states written before 2026-12-04 lack it
        got_shards = shard_names(group, batched) if want is not None else None
        if got_shards is not None and list(got_shards) != list(want):
            first = next(i for i, (a, b) in enumerate(zip(got_shards, want, strict=False)) if a != b)
            # (the keys were compared above: where both are known they are the checkpoint's)
            shown = repr(desc["keys"][first]) if desc["keys"] is not None and key is not None else "?"
            raise ResumeError(
                f"the source is not where the checkpoint left it: sample {first} of the in-flight "
                f"micro-batch (key {shown}) comes from shard {got_shards[first]!r}, the "
                f"checkpoint's came from {want[first]!r} (keys alone matched: shards that number "
                f"their samples alike); {_where(state, items[0])}"
            )
        group.keep = desc["keep"].numpy().astype(bool)
        group.weight = None if desc["weight"] is None else desc["weight"].numpy().astype(np.float64)
        group.kept_index = np.flatnonzero(group.keep)
        if weight_field is not None:
            attach_weights(group, batched, weight_field)
        group.skip = min(emitted, group.n_kept)
        emitted -= group.skip
        ledger.pending.append(group)
        groups.append(group)
    ledger.emitted = int(state["emitted"])
    return groups


def check_next(reader: Reader, state: Mapping[str, Any], source: Any, batched: bool, key: Any) -> None:
    """``ResumeError`` unless the resumed source starts with the item the checkpoint ``state``
    saw next (or has ended, if the checkpoint's had). ``source``: the tracked source, or None."""
    want, ended = state.get("next_key"), bool(state.get("ended", False))
    want_shard = state.get("next_shard")  # states written before 2026-12-04 lack it
    if want is None and want_shard is None and not ended:
        return  # the checkpoint did not see the next item (no keys, or nothing pending)
    if ended and source is not None:
        # a tracked source restored at its end: reading it now would start its next pass (a
        # StatefulDataLoader's iter()); a torchdata node is asked once, as its Loader asked it
        # (ask_at_end: its samplers' next epoch depends on it)
        ask = getattr(source, "ask_at_end", None)
        if ask is not None:
            ask()
        reader.ahead = END
        return
    reader.iterate()  # first: the snapshot below is the source's state inside this pass
    ahead = reader.look_ahead(source.state_dict() if source is not None else None)
    if isinstance(ahead, Raised):
        return  # raised where the pass reads it
    where = _where(state, ahead)
    if ended and ahead is not END:
        raise ResumeError(
            f"the source is not where the checkpoint left it: the checkpoint's source had ended "
            f"after item {state['consumed']}, but this one gives more (key "
            f"{first_key(ahead, batched, key)!r}); {where}"
        )
    if want_shard is not None and ahead is not END:
        got_shard = first_shard(ahead, batched)
        if got_shard is not None and got_shard != want_shard:
            raise ResumeError(
                f"the source is not where the checkpoint left it: its next item comes from shard "
                f"{got_shard!r}, the checkpoint's next came from {want_shard!r}; {where}"
            )
    if want is None or key is None:
        return
    if ahead is END:
        raise ResumeError(
            f"the source is not where the checkpoint left it: the checkpoint expected the item "
            f"with key {want!r} next, but the source gave nothing; {where}"
        )
    got = first_key(ahead, batched, key)
    if got != want:
        raise ResumeError(
            f"the source is not where the checkpoint left it: its next item has key {got!r}, "
            f"the checkpoint expected {want!r}; {where}"
        )


def shard_names(group: Group, batched: bool) -> list[str | None] | None:
    """The shard each sample of ``group`` came from (the file name in its ``__url__``: see
    ``shard_name``), or None where the samples carry none: what a checkpoint records besides
    their keys."""
    urls = field_of(group, batched, "__url__")
    if urls is None:
        return None
    names: dict[Any, str | None] = {}
    for url in urls:
        if url not in names:
            names[url] = shard_name(url) if isinstance(url, str) else None
    return [names[url] for url in urls]


# a shard's file name in a URL or a command: a tar archive's (WebDataset's shards), up to a /,
# whitespace, a quote, a query or a fragment; nothing else in a command (a header's token) is taken
_SHARD_FILE = re.compile(r"[^/\s'\"?#=&:@]+\.(?:tar|tgz|tar\.(?:gz|bz2|xz|zst|lz4))(?=$|[\s'\"?#;|&)])")


def shard_name(url: str) -> str | None:
    """The shard's file name in ``url`` (``shard-000001.tar`` of ``s3://b/train/shard-000001.tar``,
    of ``https://.../shard-000001.tar?X-Amz-Signature=...`` and of ``pipe:aws s3 cp
    s3://b/shard-000001.tar -``): what tells shards apart across a restart, where the rest of a
    URL may change (a mount point, a presigned URL's date and signature). Only a tar archive's
    name is taken; None if there is none."""
    found = _SHARD_FILE.findall(url)
    return found[-1] if found else None


def first_shard(item: Any, batched: bool) -> str | None:
    """The shard of an input item (the first row's, for a batch: ``shard_name``), or None."""
    try:
        names = shard_names(Group([item], 1, 0, None), batched)
    except Exception:
        return None
    return names[0] if names else None


def tail_entry(item: Any, batched: bool, key: Any) -> tuple[Any, str | None]:
    """What a state's ``tail`` keeps of an input item finished: its (first) key, in a form
    ``torch.load(weights_only=True)`` reads, and its shard (``first_shard``)."""
    return plain_keys([first_key(item, batched, key)])[0] if key is not None else None, first_shard(
        item, batched
    )


def note_tail(group: Group, batched: bool, key: Any) -> None:
    """``note_keys``, and the (key, shard) of ``group``'s last ``TAIL`` input items, as it is read
    (found by review, 2026-12-06: ``.map_dict(__key__=...)`` after ``.sift()`` changed them)."""
    note_keys(group, batched, key)
    if batched:  # one input item: the batch, by its first row
        group.tail = [tail_entry(group.items[0], True, key)]
        return
    keys = group.keys
    try:
        shards = shard_names(group, batched)
    except Exception:
        shards = None
    start = max(0, group.n_items - TAIL)
    group.tail = [
        (keys[i] if keys is not None else None, shards[i] if shards is not None else None)
        for i in range(start, group.n_items)
    ]


def note_keys(group: Group, batched: bool, key: Any) -> None:
    """Keep what names ``group``'s rows as it is read, before any row is handed on and a later
    stage changes a sample in place (``s["__key__"] = ...``): per sample, the keys (a list comprehension,
    cheap beside the stage's other work per sample); a batch, a copy of its key column (not a
    list of its rows: that would cost the batched hot path more). Found by review,
    2026-12-06: a plain Sifter or a SiftNode followed by such a stage refused every resume."""
    if batched:
        batch = group.items[0]
        if isinstance(key, str) and isinstance(batch, Mapping) and key in batch:
            column = batch[key]
            # a copy of the column's container, small beside the batch (a tensor of 256 ints is
            # 2 KiB): rows handed on may be views of it, which a consumer may change in place
            # (batch["__key__"] += n; the review of 2026-12-06)
            if isinstance(column, torch.Tensor):
                column = column.clone()
            elif isinstance(column, np.ndarray | list):
                column = column.copy()
            group.key_column = column
        return
    try:
        group.keys = keys_of(group, batched, key)
    except Exception:  # a key callable that fails, a sample without its key: read later, as before
        group.keys = None


def check_tail(got: list[tuple[Any, str | None]], skipped: list[Any], state: Mapping[str, Any]) -> None:
    """``ResumeError`` unless the last items a resume skipped (``got``: their ``tail_entry``;
    ``skipped``: the items, the ones the checkpoint ``state`` had finished, read again) are those
    the checkpoint's ``tail`` names: where a shard was skipped as unreadable in one run only,
    DataLoader workers' items interleave otherwise, and the item after them may still match
    (found by review, 2026-12-05)."""
    tail = state.get("tail")
    if not tail:
        return
    got = got[-len(tail) :]
    at = int(state["consumed"]) - len(got)
    for i, ((want_key, want_shard), (got_key, got_shard)) in enumerate(
        zip(tail[-len(got) :], got, strict=True)
    ):
        if (want_key is not None and got_key != want_key) or (
            want_shard is not None and got_shard is not None and got_shard != want_shard
        ):
            raise ResumeError(
                f"the source is not where the checkpoint left it: input item {at + i} (from 0) of "
                f"the {state['consumed']} the checkpoint had finished has key {got_key!r} from shard "
                f"{got_shard!r}, the checkpoint's had {want_key!r} from {want_shard!r}: the items "
                "before it differ from the run's, and resuming would hand samples on twice or "
                "never. A shard skipped as unreadable in one run and not the other (an outage that "
                "passed, a shard deleted since) does this; resume from a checkpoint taken between "
                f"passes, or {_where(state, skipped[-len(got) + i])}"
            )


def first_key(item: Any, batched: bool, key: Any) -> Any:
    """The key of an input item (the first row's, for a batch), or None."""
    try:
        # (a batch's own row count: its keys are checked against it; the review of that check,
        # 2026-12-05: counted as one row, every batch's next key read as unknown)
        rows = _batch.batch_size(item) if batched else 1
        keys = keys_of(Group([item], rows, 0, None), batched, key)
    except Exception:  # a key callable that fails: recorded as unknown, not raised here
        return None
    return keys[0] if keys else None
