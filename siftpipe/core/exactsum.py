"""The exact sum of a changing set of float32 values, whatever order they came and went in."""

from __future__ import annotations

import numpy as np

# a float32 is (-1)**sign * mantissa * 2**(max(exponent, 1) - 150), mantissa < 2**24 an integer
_EXPONENTS = 256
_SHIFT = np.maximum(np.arange(_EXPONENTS), 1) - 1  # scaled by 2**149: every float32 an integer


class ExactSum:
    """The sum of float32 values added and removed, kept exactly.

    A running float sum cancels: after one loss of 1e30 came and went, a float64 sum of a
    thousand losses of 1.0 reads 0. Here each value is split into its integer mantissa and its
    exponent, and the mantissas are summed per exponent in int64 (exact for up to 2**39 values
    at once), so the sum, and the mean taken from it, depend only on the values held now, not on
    the order or grouping of the updates that brought them (a resumed memory, refilled in
    another order, reads the same mean to the bit). Values must be finite.
    """

    __slots__ = ("_acc", "_count", "_mean")

    def __init__(self) -> None:
        self._acc = np.zeros(_EXPONENTS, dtype=np.int64)
        self._mean: float | None = None
        self._count = 0

    def clear(self) -> None:
        self._acc[:] = 0
        self._mean = None

    def change(self, added: np.ndarray, removed: np.ndarray | None = None) -> None:
        """Add the float32 values ``added`` and take away ``removed`` (values added before)."""
        bits = np.ascontiguousarray(added, dtype=np.float32).view(np.uint32).ravel()
        if removed is not None and removed.size:
            gone = np.ascontiguousarray(removed, dtype=np.float32).view(np.uint32).ravel()
            bits = np.concatenate([bits, gone])
            away = np.zeros(bits.size, dtype=bool)
            away[-gone.size :] = True
        else:
            away = None
        if not bits.size:
            return
        exponent = (bits >> np.uint32(23)) & np.uint32(0xFF)
        mantissa = (bits & np.uint32(0x7FFFFF)).astype(np.int64)
        mantissa[exponent > 0] += 1 << 23
        negative = (bits >> np.uint32(31)).astype(bool)
        if away is not None:
            negative ^= away
        mantissa[negative] *= -1
        # float64 weights sum integers below 2**53 exactly: 2**29 values of < 2**24 each at once
        for at in range(0, bits.size, 1 << 29):
            part = slice(at, at + (1 << 29))
            summed = np.bincount(exponent[part], weights=mantissa[part], minlength=_EXPONENTS)
            self._acc += summed.astype(np.int64)
        self._mean = None

    def total(self) -> int:
        """The sum, times 2**149 (an exact integer)."""
        held = np.flatnonzero(self._acc)
        return sum(int(self._acc[e]) << int(_SHIFT[e]) for e in held.tolist())

    def mean(self, count: int) -> float:
        """The sum over ``count``, correctly rounded; NaN when ``count`` is 0."""
        if not count:
            return float("nan")
        if self._mean is None or self._count != count:
            self._mean = self.total() / (count << 149)  # int / int: correctly rounded
            self._count = count
        return self._mean
