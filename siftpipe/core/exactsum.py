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
        self._add(added, 1)
        if removed is not None and removed.size:
            self._add(removed, -1)

    def _add(self, values: np.ndarray, sign: int) -> None:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.int32).ravel()
        if not bits.size:
            return
        exponent = (bits >> 23) & 0xFF
        mantissa = (bits & 0x7FFFFF) | ((exponent != 0) << 23)  # the implicit bit of normal values
        if bits.min() < 0:  # (losses are rarely below 0)
            np.negative(mantissa, out=mantissa, where=bits < 0)
        # integer adds, exact: int64 holds 2**39 mantissas of < 2**24 in one exponent's sum
        (np.add if sign > 0 else np.subtract).at(self._acc, exponent, mantissa)
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
