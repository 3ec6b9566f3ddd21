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


def scalar_key(key: Any) -> Any:
    """A tensor or array key of one element as its Python value (``tensor(5)`` and
    ``tensor([5])`` are the key ``5``, as a collated batch's column of keys gives it, (B,) or
    (B, 1)); any other key as it is."""
    if isinstance(key, torch.Tensor):
        return key.item() if key.numel() == 1 else key
    if isinstance(key, np.ndarray) and key.size == 1:
        return key.item()
    return key
