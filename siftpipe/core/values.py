"""Small checks of plain values, shared by the state checks of the stage and its parts."""

from __future__ import annotations

from typing import Any

import numpy as np


def is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= low)


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
