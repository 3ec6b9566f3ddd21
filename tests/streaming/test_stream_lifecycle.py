"""An abandoned pass (``break`` out of the loop) frees what it holds at once: the source, and with
it a DataLoader's worker processes; nothing waits for the cyclic garbage collector."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch
from torch.utils.data import default_collate

import siftpipe as sp
from siftpipe.adapters.webdataset import WebDataset, WebLoader
from siftpipe.streaming.shards import synthetic_classification, write_shards


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_an_abandoned_pass_closes_its_source_at_once(no_gc):
    closed = []

    def source():
        try:
            for i in range(1000):
                yield {"__key__": str(i), "loss": float(i)}
        finally:
            closed.append(True)

    sifter = sp.Sifter(None, lambda m, b: b["loss"].double(), sp.Uniform(0.5), micro_batch=8)
    for i, _ in enumerate(sifter(source())):
        if i == 3:
            break
    assert closed == [True]
    assert sifter.stats.seen >= 4  # the stage itself lives on, with its state
    # a new pass after an abandoned one starts cleanly
    assert len(list(sifter(source()))) > 0


def test_breaking_out_of_a_sifted_webloader_stops_its_workers_at_once(tmp_path, no_gc):
    shards = write_shards(
        synthetic_classification(400, dim=4), str(tmp_path / "t"), samples_per_shard=50, progress=False
    )
    dataset = (
        WebDataset(shards.pattern, shardshuffle=False).decode().batched(25, collation_fn=default_collate)
    )
    sifter = sp.Sifter(
        None, lambda m, b: torch.as_tensor(b["x.npy"]).pow(2).sum(1).double(), batched=True, micro_batch=None
    )
    loader = WebLoader(dataset, batch_size=None, num_workers=2).sift(sifter)
    before = len(multiprocessing.active_children())
    for i, _ in enumerate(loader):
        if i == 1:
            during = len(multiprocessing.active_children())
            break
    after = len(multiprocessing.active_children())
    assert during == before + 2
    assert after == before, "the loader's workers outlived the abandoned pass"
