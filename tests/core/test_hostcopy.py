"""Losses handed to observe() from a device: their copy to the host is waited for when the memory
applies them (not per step), the wait is the step's time in the stage's account, and a kept row's
weight goes beside the batch's tensors. The CUDA cases skip without a GPU; the meta device (not
the CPU, so the stage treats it as an accelerator) checks the placement here."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import siftpipe as sp
from siftpipe.core import batch as _batch
from siftpipe.core.hostcopy import HostCopy, host_losses
from siftpipe.core.memory import FEEDBACK

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class SlowCopy(HostCopy):
    """A copy whose arrival takes ``delay`` seconds (a GPU still running the step), or fails once."""

    def __init__(self, losses: torch.Tensor, delay: float = 0.0, fail: bool = False) -> None:
        super().__init__(losses)
        self.delay, self.fail = delay, fail

    def result(self) -> np.ndarray:
        if self.fail:
            self.fail = False
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.delay:
            t0 = time.perf_counter()
            time.sleep(self.delay)
            self.waited += time.perf_counter() - t0
            self.delay = 0.0
        return super().result()


def test_a_host_copy_is_a_copy_and_the_memory_applies_it_before_its_next_read():
    losses = torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64)
    copy = HostCopy(losses)
    losses.fill_(9.0)  # the caller reuses its buffer after observe(): the copy is not affected
    assert copy.size == 3 and copy.result().dtype == np.float32
    assert copy.result().tolist() == [0.5, 1.5, 2.5]
    memory = sp.ScoreMemory(100)
    memory.defer_keys(["a", "b", "c"], HostCopy(torch.tensor([[1.0], [2.0], [3.0]])), 0, FEEDBACK)
    assert len(memory) == 3  # a read applies it
    got, _ = memory.lookup_keys(["a", "b", "c"], 1)
    assert got.tolist() == [1.0, 2.0, 3.0]
    assert host_losses(torch.tensor([1.0, 2.0], dtype=torch.bfloat16)).dtype == np.float32


def test_a_copy_that_fails_to_arrive_loses_nothing_and_raises():
    memory = sp.ScoreMemory(100)
    memory.defer_keys(["a"], np.array([1.0]), 0, FEEDBACK)
    memory.defer_keys(["b"], SlowCopy(torch.tensor([2.0]), fail=True), 0, FEEDBACK)
    memory.defer_keys(["c"], np.array([3.0]), 0, FEEDBACK)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        memory.flush()
    assert len(memory) == 3  # the next read applies all three, in order
    assert memory.lookup_keys(["a", "b", "c"], 1)[0].tolist() == [1.0, 2.0, 3.0]


def _recipe_stage(n: int) -> sp.Sifter:
    return sp.recipe(
        None, "cross_entropy", budget=4 * n, batched=True, output_batch=8, seed=0, cost_guard=False
    )


def _batches(n: int, rows: int, device: str = "cpu"):
    for start in range(0, n, rows):
        idx = torch.arange(start, min(n, start + rows))
        yield {"__key__": idx, "x": torch.zeros(len(idx), 3, device=device)}


def test_waiting_for_a_device_copy_is_the_steps_time_not_the_stages():
    n, delay = 64, 0.4
    sifter = _recipe_stage(n)
    for epoch in range(2):
        sifter.set_epoch(epoch)
        for batch in sifter(_batches(n, 32)):
            keys = batch["__key__"]
            losses = torch.rand(len(keys))
            if epoch == 0 and int(keys[0]) == 0:
                # the first step's losses take `delay` to arrive; the stage waits for them when it
                # decides the next input batch
                sifter._decider.observe(keys, SlowCopy(losses, delay=delay))
            else:
                sifter.observe(keys, losses)
    assert sifter.memory is not None and sifter.memory.waited >= delay
    stats = sifter.stats
    # the wait happened inside the stage (deciding the next input batch) but was the step's: before,
    # it counted as the stage's own time (>= delay)
    assert stats.stage_seconds < delay <= stats.step_seconds


def test_observe_waits_for_nothing_when_its_losses_are_on_the_host():
    sifter = _recipe_stage(16)
    for batch in sifter(_batches(16, 8)):
        sifter.observe(batch["__key__"], torch.ones(len(batch["__key__"])))
    assert sifter.memory is not None and len(sifter.memory) == 16 and sifter.memory.waited == 0.0


def test_the_weight_column_goes_beside_the_batchs_tensors():
    # the meta device stands for an accelerator here: not the CPU, no data
    assert _batch.accelerator_of({"k": [1, 2], "i": torch.arange(2), "x": torch.zeros(2, device="meta")}) == (
        torch.device("meta")
    )
    assert _batch.accelerator_of({"i": torch.arange(2), "x": torch.zeros(2)}) is None
    assert _batch.accelerator_of((torch.zeros(2), [torch.zeros(2, device="meta")])) == torch.device("meta")
    n = 48
    sifter = _recipe_stage(n)
    for epoch in range(2):
        sifter.set_epoch(epoch)
        for batch in sifter(_batches(n, 24, device="meta")):
            assert batch["__sift_weight__"].device.type == "meta" and batch["x"].device.type == "meta"
            assert batch["__key__"].device.type == "cpu"
            sifter.observe(batch["__key__"], torch.rand(len(batch["__key__"])))
    for batch in _recipe_stage(n)(_batches(n, 24)):
        assert batch["__sift_weight__"].device.type == "cpu"


@cuda
def test_observe_from_cuda_remembers_what_a_cpu_step_would():
    n = 256
    decided = []
    for device in ("cpu", "cuda"):
        sifter = _recipe_stage(n)
        gen = torch.Generator().manual_seed(0)
        kept = []
        for epoch in range(3):
            sifter.set_epoch(epoch)
            for batch in sifter(_batches(n, 64, device=device)):
                keys = batch["__key__"]
                assert batch["__sift_weight__"].device.type == device
                losses = torch.rand(len(keys), generator=gen).to(device)
                sifter.observe(keys, losses)
                losses.fill_(7.0)  # a reused buffer: the queued copy took the values before this
                kept += keys.tolist()
        decided.append((kept, sifter.memory.losses().tolist()))  # type: ignore[union-attr]
    assert decided[0] == decided[1]


@cuda
def test_rows_of_a_cuda_batch_are_taken_with_an_index_copied_without_waiting():
    x = torch.arange(12, device="cuda").reshape(6, 2)
    got = _batch.take({"x": x, "k": ["a", "b", "c", "d", "e", "f"]}, np.array([1, 4], dtype=np.int64))
    assert got["x"].tolist() == [[2, 3], [8, 9]] and got["k"] == ["b", "e"]
