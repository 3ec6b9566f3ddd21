import math
from fractions import Fraction

import numpy as np

from siftpipe.core.exactsum import ExactSum


def exact_mean(values: np.ndarray) -> float:
    return float(sum((Fraction(float(v)) for v in values), Fraction(0)) / len(values))


def test_the_mean_is_the_correctly_rounded_mean_of_the_values_held_however_they_came_and_went():
    rng = np.random.default_rng(0)
    # every float32 range at once: subnormals, ordinary losses, huge ones, negatives, zeros
    pool = np.concatenate(
        [
            rng.exponential(size=500),
            rng.exponential(size=50) * 1e30,
            rng.exponential(size=50) * 1e-40,
            -rng.exponential(size=50),
            np.zeros(10),
            [np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45],
        ]
    ).astype(np.float32)
    held: list[float] = []
    total = ExactSum()
    for _ in range(300):
        add = rng.choice(pool, size=int(rng.integers(0, 20)))
        take = int(rng.integers(0, len(held) + 1)) if held else 0
        gone_at = rng.choice(len(held), size=min(take, 10), replace=False) if take else np.zeros(0, int)
        gone = np.array([held[i] for i in gone_at], dtype=np.float32)
        held = [v for i, v in enumerate(held) if i not in set(gone_at.tolist())] + add.tolist()
        total.change(add, gone)
        if held:
            assert total.mean(len(held)) == exact_mean(np.array(held, dtype=np.float32))
    # refilled in another order and grouping: the same bits
    again = ExactSum()
    values = np.array(held, dtype=np.float32)
    for part in np.array_split(values[::-1], 7):
        again.change(part)
    assert again.mean(len(values)) == total.mean(len(values))


def test_a_huge_value_that_came_and_went_leaves_no_trace():
    total = ExactSum()
    total.change(np.ones(1000, np.float32))
    total.change(np.array([1e30], np.float32), np.array([1.0], np.float32))
    assert total.mean(1000) > 1e26
    total.change(np.array([1.0], np.float32), np.array([1e30], np.float32))
    # a float64 running sum reads 0.0 here: 1000 + 1e30 - 1 - 1e30
    assert total.mean(1000) == 1.0
    assert math.isnan(total.mean(0))
    total.clear()
    assert total.mean(5) == 0.0
