"""Small checks of plain values, shared by the state checks of the stage and its parts."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= low)


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def plain_keys(keys: Any) -> Any:
    """``keys`` (a list, or None) with numpy scalars as Python values, for a state: a numpy
    scalar does not load with ``torch.load``'s default ``weights_only=True`` (found by review,
    2026-12-06: keys ``ids[i]`` of an array made every checkpoint refuse to load). The memory
    and the resume check read both alike (``np.int64(5) == 5``, one hash)."""
    if isinstance(keys, list) and any(isinstance(k, np.generic | tuple | list) for k in keys):
        return [_plain(k) for k in keys]
    return keys


def _plain(key: Any) -> Any:
    """A key with the numpy scalars in it, at any depth of tuples and lists, as Python values
    (``("shard-0", ids[i])``: the review of ``plain_keys``)."""
    if isinstance(key, np.generic):
        return key.item()
    if isinstance(key, tuple | list) and any(isinstance(k, np.generic | tuple | list) for k in key):
        return type(key)(_plain(k) for k in key) if type(key) in (tuple, list) else key
    return key


def scalar_key(key: Any) -> Any:
    """A tensor or array key as its Python value(s), as a collated batch's column of keys gives
    each row: a 0-d one (``tensor(5)``) as its value ``5`` (a (B,) column's row), any other as
    its list (``tensor([5])`` as ``[5]``, a (B, 1) column's row); any other key as it is."""
    if isinstance(key, torch.Tensor | np.ndarray):
        return key.item() if key.ndim == 0 else key.tolist()
    return key
