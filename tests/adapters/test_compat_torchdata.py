"""siftpipe.nodes against torchdata's documented behaviours: a node's save/load state at every
midpoint (torchdata's ``run_test_save_load_state``, written again in tests/contract.py), a
``StatefulDataLoader`` with two workers resumed at every snapshot point, and a ``ShardSource``
iterated by DataLoader workers, which must split the shards as webdataset does and never hand on
a sample twice."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, default_collate
from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper
from torchdata.stateful_dataloader import StatefulDataLoader

import siftpipe as sp
from siftpipe.adapters.nodes import ShardSource, SiftNode
from siftpipe.streaming.shards import decode_sample, synthetic_classification, write_shards
from tests.common import roundtrip
from tests.contract import output_keys, run_save_load_state, signature

N, PER_SHARD = 60, 10
ALL_KEYS = [f"{i:09d}" for i in range(N)]
decode = functools.partial(decode_sample, to_torch=True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat-td")
    return write_shards(
        synthetic_classification(N, dim=3), str(root / "train"), samples_per_shard=PER_SHARD, progress=False
    )


class NodeDataset(IterableDataset):
    """A torchdata node as an IterableDataset: how a ``ShardSource`` goes into a DataLoader (every
    worker iterates its own copy) or a StatefulDataLoader (which saves and restores each worker's
    copy through ``state_dict``/``load_state_dict``)."""

    def __init__(self, node):
        self.node = node
        self.pending = None

    def __iter__(self):
        self.node.reset(self.pending)
        self.pending = None
        return self.node

    def state_dict(self):
        return self.node.state_dict()

    def load_state_dict(self, state):
        self.pending = state


def keys(items):
    return [s["__key__"] for s in items]


# ---------------------------------------------------------------------------------- save/load state


def test_shard_source_passes_the_save_load_contract_at_every_midpoint(shards):
    for midpoint in range(1, N):
        run_save_load_state(lambda: ShardSource(shards.urls, shuffle=True, seed=3), midpoint)


def test_a_sift_node_passes_the_save_load_contract_at_every_midpoint(shards):
    def make():
        source = ParallelMapper(ShardSource(shards.urls), decode, num_workers=2, method="thread")
        batches = Mapper(Batcher(source, batch_size=8, drop_last=False), default_collate)
        sifter = sp.Sifter(
            None,
            lambda m, b: b["x.npy"].pow(2).sum(1).double(),
            sp.RelativeProbabilistic(1.0, 20),
            batched=True,
            micro_batch=None,
            output_batch=5,
            seed=1,
        )
        return SiftNode(batches, sifter)

    epoch0, _ = run_save_load_state(make, 1)
    for midpoint in range(2, len(epoch0)):
        run_save_load_state(make, midpoint)


# ---------------------------------------------------------------------------------- DataLoader workers


@pytest.mark.parametrize("workers,count", [(1, 6), (2, 6), (2, 5)])
def test_dataloader_workers_split_the_shards_and_hand_on_each_sample_once(shards, workers, count):
    urls = shards.urls[:count]
    loader = DataLoader(NodeDataset(ShardSource(urls)), batch_size=None, num_workers=workers)
    got = keys(loader)
    assert sorted(got) == ALL_KEYS[: count * PER_SHARD], "every sample exactly once"
    # the same shards per worker, and so the same interleaving, as webdataset's split_by_worker
    theirs = DataLoader(wds.WebDataset(urls, shardshuffle=False), batch_size=None, num_workers=workers)
    assert got == keys(theirs)


def test_ranks_and_workers_together_cover_every_sample_once(shards):
    got = []
    for rank in range(2):
        source = ShardSource(shards.urls, shuffle=True, seed=4, rank=rank, world_size=2)
        got += keys(DataLoader(NodeDataset(source), batch_size=None, num_workers=2))
    assert sorted(got) == ALL_KEYS


def first_seen_urls(items):
    """Shard URLs in the order their first sample came (with shards of equal size, a DataLoader's
    round robin over its workers puts them back in the epoch's shard order)."""
    return list(dict.fromkeys(s["__url__"] for s in items))


def test_a_shuffled_shard_source_in_fresh_workers_reads_the_epoch_set_on_it(shards):
    # without persistent workers, each epoch's workers start from a copy of the object here, which
    # never reads: before set_epoch, every epoch repeated epoch 0's shard order
    source = ShardSource(shards.urls, shuffle=True, seed=2)
    loader = DataLoader(NodeDataset(source), batch_size=None, num_workers=2)
    expected = [ShardSource(shards.urls, shuffle=True, seed=2).order(epoch) for epoch in range(3)]
    assert len({tuple(o) for o in expected}) == 3
    got = []
    for epoch in range(3):
        source.set_epoch(epoch)
        got.append(first_seen_urls(loader))
    assert got == expected
    with pytest.raises(sp.ConfigError, match="set_epoch takes the epoch number"):
        source.set_epoch(-1)


@pytest.mark.parametrize("set_epoch", [True, False])
def test_a_sifter_hands_its_epoch_to_a_shard_source_in_fresh_workers(shards, set_epoch):
    source = ShardSource(shards.urls, shuffle=True, seed=2)
    loader = DataLoader(NodeDataset(source), batch_size=None, num_workers=2)
    sifter = sp.Sifter(
        None,
        lambda model, items: torch.zeros(len(items), dtype=torch.float64),
        sp.Uniform(1.0),  # keeps every sample: the order handed on is the order read
        micro_batch=10,
        collate_fn=list,
        seed=0,
    )
    first = 2 if set_epoch else 0
    expected = [ShardSource(shards.urls, shuffle=True, seed=2).order(e) for e in range(first, first + 3)]
    got, seen = [], []
    for epoch in range(first, first + 3):
        if set_epoch:
            sifter.set_epoch(epoch)
        before = sifter.stats.seen
        kept = list(sifter(loader))
        assert sifter.stats.seen - before == N
        got.append(first_seen_urls(kept))
        seen.append(sifter.epoch)
    assert seen == list(range(first, first + 3))
    assert got == expected


def _keep_all():
    return sp.Sifter(
        None,
        lambda model, items: torch.zeros(len(items), dtype=torch.float64),
        sp.Uniform(1.0),
        micro_batch=10,
        collate_fn=list,
        seed=0,
    )


def _order(shards, epoch):
    return ShardSource(shards.urls, shuffle=True, seed=2).order(epoch)


def test_a_node_reset_by_hand_before_each_pass_reads_the_sifters_epoch(shards):
    # torchdata's own pattern: reset(None), then iterate; the sifter's epoch applies to the pass
    # that reset started (it once landed on the pass after: epoch 0's order twice, then one behind)
    sifter, node = _keep_all(), ShardSource(shards.urls, shuffle=True, seed=2)
    for epoch in range(3):
        node.reset(None)
        assert first_seen_urls(sifter(node)) == _order(shards, epoch) and node.epoch == epoch


def test_an_epoch_set_on_the_source_wins_over_the_sifters(shards):
    sifter, node = _keep_all(), ShardSource(shards.urls, shuffle=True, seed=2)
    loader = Loader(node)
    for epoch in range(2):
        node.set_epoch(10 + epoch)
        assert first_seen_urls(sifter(loader)) == _order(shards, 10 + epoch)
        assert sifter.epoch == epoch
    assert first_seen_urls(sifter(loader)) == _order(shards, 2)  # then the sifter's again


def test_fresh_workers_read_the_sifters_epoch_after_a_resume_between_passes(shards):
    def loader():
        return StatefulDataLoader(
            NodeDataset(ShardSource(shards.urls, shuffle=True, seed=2)), batch_size=None, num_workers=2
        )

    sifter, first = _keep_all(), loader()
    for epoch in range(2):
        assert first_seen_urls(sifter(first)) == _order(shards, epoch)
    state = roundtrip(sifter.state_dict())
    assert not state["pass_open"] and state["source"] is not None
    # a new process: new objects, the state loaded between passes (the loader's too)
    resumed, second = _keep_all(), loader()
    resumed.load_state_dict(state)
    assert first_seen_urls(resumed(second)) == _order(shards, 2) and resumed.epoch == 2


def test_a_node_given_again_without_a_loader_warns_that_its_pass_read_nothing(shards):
    # a torchdata node starts a new epoch only on reset(None), which a Loader calls; iterated
    # again without one it yields nothing, and the sifter says so instead of training nothing
    sifter = sp.Sifter(
        None,
        lambda model, items: torch.zeros(len(items), dtype=torch.float64),
        sp.Uniform(1.0),
        micro_batch=10,
        collate_fn=list,
    )
    node = ShardSource(shards.urls)
    assert len(list(sifter(node))) == N
    with pytest.warns(sp.EmptyPassWarning, match="ShardSource"):
        assert list(sifter(node)) == []
    loader = Loader(ShardSource(shards.urls))
    for _ in range(2):
        assert len(list(sifter(loader))) == N


def test_a_worker_left_without_shards_is_a_config_error(shards):
    source = ShardSource(shards.urls[:3], rank=1, world_size=2)  # rank 1 gets one shard
    loader = DataLoader(NodeDataset(source), batch_size=None, num_workers=2)
    it = iter(loader)
    try:
        with pytest.raises(sp.ConfigError, match=r"worker 1 of 2 \(rank 1 of 2\) gets none of this rank's 1"):
            list(it)
    finally:
        it._shutdown_workers()


def test_a_shard_source_pickles_after_it_started(shards):
    source = ShardSource(shards.urls)
    loader = Loader(source)
    it = iter(loader)
    next(it)
    copy = pickle.loads(pickle.dumps(source))
    assert keys(copy) == ALL_KEYS  # a copy starts a pass of its own; the position is in the state


def test_a_worker_state_restored_elsewhere_is_refused(shards, monkeypatch):
    monkeypatch.setenv("WORKER", "1")
    monkeypatch.setenv("NUM_WORKERS", "2")
    source = ShardSource(shards.urls)
    loader = Loader(source)
    it = iter(loader)
    assert [next(it)["__key__"] for _ in range(3)] == ALL_KEYS[PER_SHARD : PER_SHARD + 3]
    state = roundtrip(loader.state_dict())
    monkeypatch.setenv("NUM_WORKERS", "3")
    other = Loader(ShardSource(shards.urls))
    other.load_state_dict(state)
    with pytest.raises(
        sp.ResumeError, match=r"taken in DataLoader worker 1 of 2, this source runs in worker 1 of 3"
    ):
        list(other)


# ---------------------------------------------------------------------------------- StatefulDataLoader


def stateful(shards, **kw):
    return StatefulDataLoader(
        NodeDataset(ShardSource(shards.urls, **kw)), batch_size=None, num_workers=2, snapshot_every_n_steps=1
    )


def test_stateful_dataloader_over_a_shard_source_resumes_at_every_snapshot_point(shards):
    reference = keys(stateful(shards))
    assert sorted(reference) == ALL_KEYS
    for cut in range(N + 1):
        first = stateful(shards)
        it = iter(first)
        head = [next(it)["__key__"] for _ in range(cut)]
        state = roundtrip(first.state_dict())
        del it
        second = stateful(shards)
        second.load_state_dict(state)
        assert head + keys(second) == reference, f"cut {cut}"


def test_stateful_dataloader_and_sifter_resume_together_at_every_snapshot_point(shards):
    def make_sifter():
        return sp.Sifter(
            None,
            lambda m, b: b["x.npy"].pow(2).sum(1).double(),
            sp.TopFraction(0.5),
            batched=True,
            micro_batch=None,
            seed=5,
        )

    def loader():
        dataset = NodeDataset(Mapper(Batcher(Mapper(ShardSource(shards.urls), decode), 4), default_collate))
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2, snapshot_every_n_steps=1)

    batches = list(make_sifter()(loader()))
    reference = [signature(b) for b in batches]
    kept = output_keys(batches)
    # each worker reads 3 shards (30 samples): 7 full batches of 4 (Batcher drops the last 2),
    # of which TopFraction keeps 2; no sample twice
    assert len(kept) == len(set(kept)) == 2 * 7 * 2
    for cut in range(len(reference) + 1):
        sifter = make_sifter()
        it = sifter(loader())
        head = [signature(next(it)) for _ in range(cut)]
        state = roundtrip(sifter.state_dict())
        del it
        again = make_sifter()
        again.load_state_dict(state)
        assert head + [signature(b) for b in again(loader())] == reference, f"cut {cut}"
