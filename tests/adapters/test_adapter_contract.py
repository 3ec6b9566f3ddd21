"""One contract, every adapter: the plain iterator, the WebDataset chain (two DataLoader workers)
and the torchdata node (two ParallelMapper worker processes) read the same shards and must make
the same decisions with the same model weights; each resumes exactly from a checkpoint (the
contract of tests/contract.py); kept samples are a subset of the input, in input order; and the
counts add up."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import default_collate
from torchdata.nodes import Batcher, Mapper, ParallelMapper, Unbatcher

import siftpipe as sp
from siftpipe.adapters.nodes import ShardSource, SiftNode
from siftpipe.adapters.webdataset import WebDataset, WebLoader
from siftpipe.streaming.shards import decode_sample, synthetic_classification, write_shards
from tests.contract import Adapter, OneEpochLoader, PlainList, check_save_load, output_keys, signature

N, PER_SHARD = 320, 40
ALL_KEYS = [f"{i:09d}" for i in range(N)]


def to_sample(raw):
    """Decoded shard sample -> the training sample every adapter works with."""
    s = decode_sample(raw) if isinstance(raw.get("cls"), bytes) else raw
    return {"__key__": s["__key__"], "x": torch.from_numpy(s["x.npy"]), "y": s["cls"]}


def rows(batch):
    """A collated batch -> its rows (what webdataset's .unbatched() makes of a dict batch)."""
    n = len(batch["__key__"])
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


MODEL = model()
POLICIES = {
    "relative": lambda: sp.RelativeProbabilistic(beta=1.0, history=80),
    "top": lambda: sp.TopFraction(0.35),
    "prune": lambda: sp.PruneEasy(ratio=0.6, history=60),
}


def make_sifter(mode, policy):
    batched = mode == "batched"
    return sp.Sifter(
        MODEL,
        sp.CrossEntropy("x", "y"),
        POLICIES[policy](),
        micro_batch=None if batched else 16,
        batched=batched,
        delay=24,
        seed=11,
        output_batch=None if batched else 20,
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    return write_shards(
        synthetic_classification(N, dim=6, classes=4, hard_fraction=0.2, seed=4),
        str(root / "train"),
        samples_per_shard=PER_SHARD,
        progress=False,
    )


def Plain(shards, mode, policy):
    """The stage over a list of the shards' samples (or worker batches)."""
    raw = [to_sample(s) for s in WebDataset(shards.urls, shardshuffle=False).decode()]
    batches = [default_collate(raw[i : i + PER_SHARD]) for i in range(0, N, PER_SHARD)]
    data = batches if mode == "batched" else [r for b in batches for r in rows(b)]
    return PlainList(data, make_sifter(mode, policy))


class WebDatasetChain(Adapter):
    """Decode and batch in two DataLoader workers, sift after the WebLoader."""

    def __init__(self, shards, mode, policy):
        dataset = (
            WebDataset(shards.pattern, shardshuffle=False)
            .decode()
            .map(to_sample)
            .batched(PER_SHARD, collation_fn=default_collate)
        )
        loader = WebLoader(dataset, batch_size=None, num_workers=2)
        if mode != "batched":
            loader = loader.unbatched()
        self.chain = loader.sift(make_sifter(mode, policy))
        self.sifter = self.chain.sifter

    def start(self):
        return iter(self.chain)

    def state(self):
        return self.sifter.state_dict()

    def resume(self, state):
        self.sifter.load_state_dict(state)  # the chain skips what the checkpoint had finished
        return iter(self.chain)

    def close(self):
        self.sifter.close()


class TorchdataNode(OneEpochLoader):
    """ShardSource -> decode in two worker processes -> batch -> SiftNode, under a Loader."""

    def __init__(self, shards, mode, policy):
        source = ShardSource(shards.pattern)
        node = ParallelMapper(source, to_sample, num_workers=2, method="process")
        node = Mapper(Batcher(node, batch_size=PER_SHARD, drop_last=False), default_collate)
        if mode != "batched":
            node = Unbatcher(Mapper(node, rows))
        self.sifter = make_sifter(mode, policy)
        super().__init__(SiftNode(node, self.sifter))  # one epoch, as the other adapters


ADAPTERS = {"plain": Plain, "webdataset": WebDatasetChain, "torchdata": TorchdataNode}
CUTS = {"batched": [0, 1, 3, 6, 8], "per_sample": [0, 1, 4, 9]}


def kept_rows(outputs):
    return sum(len(o["__key__"]) if isinstance(o["__key__"], list) else 1 for o in outputs)


@pytest.mark.parametrize("mode", ["batched", "per_sample"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_adapter_makes_the_same_decisions_and_the_counts_add_up(shards, mode, policy):
    results = {}
    for name, cls in ADAPTERS.items():
        adapter = cls(shards, mode, policy)
        outputs = list(adapter.start())
        stats = adapter.sifter.stats
        assert stats.seen == N, name
        assert stats.kept + stats.dropped == stats.seen, name
        assert kept_rows(outputs) == stats.kept, name
        assert 0 < stats.kept < N, f"{name}: the policy must drop some samples for this test to mean anything"
        keys = output_keys(outputs)
        assert keys == sorted(keys) and set(keys) <= set(ALL_KEYS), f"{name}: kept samples out of input order"
        results[name] = [signature(o) for o in outputs]
    assert results["webdataset"] == results["plain"]
    assert results["torchdata"] == results["plain"]


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize("mode", ["batched", "per_sample"])
def test_every_adapter_resumes_exactly(shards, adapter, mode):
    policy = "prune" if mode == "batched" else "relative"  # weights attached / probabilistic
    check_save_load(
        functools.partial(ADAPTERS[adapter], shards, mode, policy), CUTS[mode], input_keys=ALL_KEYS
    )
