"""A bounded window of recent losses with fast percentile and mean queries."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, ResumeError


def physical_memory() -> int | None:
    """Bytes of physical memory on this machine, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(nbytes: int, what: str, fix: str) -> None:
    """Raise ``ConfigError`` if ``nbytes`` for ``what`` exceed this machine's physical memory."""
    total = physical_memory()
    if total is not None and nbytes > total:
        raise ConfigError(
            f"{what} needs {_gib(nbytes)} of memory, more than this machine's {_gib(total)}; {fix}"
        )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


# windows up to this many losses are re-sorted on each update (cheaper than inserting there)
_RESORT_BELOW = 2048
# after a window with equal losses, extend_percentile searches for this many calls before it
# tries the one-pass way again (which costs a little more than the searches when it fails)
_TIED_CALLS = 64
_POSITIONS = np.arange(_RESORT_BELOW, dtype=np.intp)
_POSITIONS.flags.writeable = False


def _positions(count: int) -> np.ndarray:
    """0, 1, ..., count - 1 (count <= _RESORT_BELOW), without allocating them each time."""
    return _POSITIONS[:count]


class LossHistory:
    """The last ``size`` finite losses, kept both in arrival order and sorted.

    Adding a micro-batch of ``m`` losses costs ``O(size)`` memory moves (no re-sort), and a
    percentile query for ``m`` losses costs ``O(m log size)``; memory is ``16 * size`` bytes.

    Args:
        size: Window length, in losses (samples).
    """

    def __init__(self, size: int) -> None:
        if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"history size must be a positive number of samples, got {size!r}")
        fix = "a window of 500 to 100,000 losses is typical (percentiles settle long before)"
        check_fits(16 * int(size), f"a loss history of {int(size):,} losses (16 bytes each)", fix)
        self.size = int(size)
        try:
            self._ring = np.zeros(self.size, dtype=np.float64)
        except MemoryError:
            raise ConfigError(
                f"a loss history of {self.size:,} losses (16 bytes each) does not fit in memory; {fix}"
            ) from None
        self._pos = 0  # next slot of the ring to write
        self._count = 0  # losses in the window, <= size
        self._sorted = np.zeros(0, dtype=np.float64)
        self._sum: float | None = 0.0
        self._total = 0  # losses ever added: the state says how many of them the window holds
        self._tied = 0  # extend_percentile calls left that skip the one-pass way (ties were seen)

    def __len__(self) -> int:
        return self._count

    def extend(self, losses: np.ndarray) -> None:
        """Add finite ``losses`` (oldest first), evicting the oldest beyond ``size``."""
        new = np.asarray(losses, dtype=np.float64).ravel()
        if new.size == 0:
            return
        self._total += new.size
        if new.size >= self.size:
            self._ring[:] = new[-self.size :]
            self._pos = 0
            self._count = self.size
            self._sorted = np.sort(self._ring)
            self._sum = float(self._ring.sum())
            return
        k = new.size
        if self.size <= _RESORT_BELOW:
            # small windows: writing the ring and re-sorting it beats moving entries around
            self._write_ring(new)
            self._sorted = np.sort(self._ring[: self._count])
            return
        slots = (self._pos + np.arange(k)) % self.size
        evict = self._count + k - self.size
        if evict > 0:
            # the oldest `evict` entries are the ones the new losses overwrite first
            oldest = (self._pos - self._count + np.arange(evict)) % self.size
            gone = np.sort(self._ring[oldest])
            at = np.searchsorted(self._sorted, gone, side="left")
            # equal values removed more than once sit side by side in the sorted array
            at += np.arange(evict) - np.searchsorted(gone, gone, side="left")
            self._sorted = np.delete(self._sorted, at)
        self._ring[slots] = new
        self._pos = int((self._pos + k) % self.size)
        self._count = min(self.size, self._count + k)
        new_sorted = np.sort(new)
        self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, new_sorted), new_sorted)
        # summed from the window when asked, never kept running: one huge loss absorbed every
        # later addition and its eviction left a sum near 0 for up to a lap of the ring (found
        # by review, 2026-12-05: PruneEasy stopped pruning for a window, and a resume, which
        # sums afresh, decided otherwise)
        self._sum = None

    def _write_ring(self, new: np.ndarray) -> None:
        """Write ``new`` (fewer than ``size`` losses) into the ring after its newest entry,
        wrapping round; the sorted copy is the caller's to make."""
        k, size, start = new.size, self.size, self._pos
        end = start + k
        if end <= size:
            self._ring[start:end] = new
        else:
            cut = size - start
            self._ring[start:] = new[:cut]
            self._ring[: end - size] = new[cut:]
        self._pos = end % size
        self._count = min(size, self._count + k)
        self._sum = None  # summed when asked: most policies never ask

    def extend_percentile(self, losses: np.ndarray) -> np.ndarray:
        """``extend(losses)``, then ``percentile(losses)``: the same result, in one pass where it can.

        A small window is re-sorted on every update anyway; sorted indirectly instead, it says
        where each new loss landed, which is its rank when no two losses in the window are
        equal, so the binary searches (and the sort of the new losses they need) are skipped."""
        new = np.asarray(losses, dtype=np.float64)
        k = new.size
        size = self.size
        if new.ndim != 1 or not 0 < k < size or size > _RESORT_BELOW or self._tied:
            # equal losses lately (bf16 or rounded losses tie often): the searches, for a while
            self._tied = max(0, self._tied - 1)
            self.extend(new)
            return self.percentile(new)
        self._total += k
        start = self._pos
        end = start + k
        self._write_ring(new)
        count = self._count
        window = self._ring[:count]
        order = window.argsort()
        ordered = self._sorted = window[order]
        # count_nonzero: one C call, where ndarray.any() goes through a ufunc reduction
        if count > 1 and np.count_nonzero(ordered[1:] == ordered[:-1]):
            self._tied = _TIED_CALLS
            return self.percentile(new)  # equal losses: their mid-rank needs the searches
        where = np.empty(count, dtype=np.intp)
        where[order] = _positions(count)
        # the new losses sit at ring slots start..end (wrapping); no ties: mid-rank = rank + 1/2
        rank = where[start:end] if end <= size else np.concatenate((where[start:], where[: end - size]))
        rank *= 2
        rank += 1
        return rank / (2.0 * count)

    def percentile(self, losses: np.ndarray) -> np.ndarray:
        """Mid-rank percentile in [0, 1] of each loss among the window (0.5 if it is empty)."""
        values = np.asarray(losses, dtype=np.float64)
        n = self._count
        if n == 0:
            return np.full(values.shape, 0.5)
        window = self._sorted
        # binary searches for keys in random order mispredict nearly every branch; sorted keys
        # let each search start where the last ended, which more than pays for the sort
        flat = values.ravel()
        order = np.argsort(flat)
        keys = flat[order]
        ranks = np.searchsorted(window, keys, side="left")
        ranks += np.searchsorted(window, keys, side="right")
        out = np.empty(keys.size)
        out[order] = ranks
        out /= 2.0 * n
        return out.reshape(values.shape)

    def mean(self) -> float:
        """Mean of the window (NaN if empty)."""
        if not self._count:
            return float("nan")
        if self._sum is None:
            self._sum = float(self._sorted.sum())
        ordered = self._sorted
        # a sum's rounding puts the mean of equal losses an ulp beside them, and then half of
        # them read as below it (found by review, 2026-12-05: PruneEasy pruned and reweighted
        # ~20% of a stream of equal losses); a mean never lies outside the values it is of
        return min(max(self._sum / self._count, float(ordered[0])), float(ordered[-1]))

    def values(self) -> np.ndarray:
        """The window's losses, oldest first."""
        start = (self._pos - self._count) % self.size
        return np.roll(self._ring, -start)[: self._count].copy()

    def quantiles(self, q: np.ndarray) -> np.ndarray:
        """Quantiles ``q`` (in [0, 1]) of the window."""
        if self._count == 0:
            return np.full(np.shape(q), np.nan)
        return np.quantile(self._sorted, q)

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "values": torch.from_numpy(self.values()), "total": self._total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; raises ``ResumeError`` (and changes nothing) if it does not fit."""
        size, values = state.get("size"), state.get("values")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ResumeError(f"the loss history's state has no window size (got {size!r}); it is damaged")
        if not (
            isinstance(values, torch.Tensor)
            and values.is_floating_point()
            and values.ndim == 1
            and values.shape[0] <= size
            and bool(torch.isfinite(values).all())
        ):
            raise ResumeError(
                f"the loss history's state must hold at most {size} finite losses in a 1-d float "
                f"tensor, got {type(values).__name__} {getattr(values, 'shape', '')}; it is damaged"
            )
        total = state.get("total", values.shape[0])
        if not (
            isinstance(total, int) and not isinstance(total, bool) and values.shape[0] == min(size, total)
        ):
            raise ResumeError(
                f"the loss history's state holds {values.shape[0]} losses, but {total!r} were added to a "
                f"window of {size}: it is damaged (truncated?)"
            )
        if int(state["size"]) != self.size:
            raise ResumeError(
                f"the checkpoint's loss history holds {int(state['size'])} losses but this policy's "
                f"holds {self.size}; construct the policy with history={int(state['size'])} to resume"
            )
        values = state["values"].numpy().astype(np.float64)
        self._ring[:] = 0.0
        self._count = 0
        self._pos = 0
        self._sorted = np.zeros(0, dtype=np.float64)
        self._sum = 0.0
        self.extend(values)
        self._total = int(total)
