"""The StatefulDataLoader recipe: the Sifter tracks the loader (state_dict/load_state_dict), so
one checkpoint holds both, and resuming with two workers equals the uninterrupted run."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import Dataset, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

import siftpipe as sp
from siftpipe.adapters.webdataset import WebDataset
from siftpipe.streaming.shards import decode_sample, synthetic_classification, write_shards
from tests.common import roundtrip
from tests.contract import Adapter, check_save_load, output_keys

N = 360
ALL_KEYS = [f"{i:09d}" for i in range(N)]


class Samples(Dataset):
    def __init__(self):
        self.samples = [decode_sample(s, to_torch=False) for s in _raw()]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        return {"__key__": s["__key__"], "x": torch.from_numpy(s["x.npy"]), "y": s["cls"]}


def _raw():
    return ({k: v for k, v in s.items()} for s in synthetic_classification(N, dim=6))


def make_sifter(model=None, **kw):
    scorer = sp.CrossEntropy("x", "y") if model is not None else (lambda m, b: b["x"].pow(2).sum(1).double())
    return sp.Sifter(
        model, scorer, sp.RelativeProbabilistic(1.0, 64), batched=True, micro_batch=None, seed=2, **kw
    )


class LoaderAdapter(Adapter):
    """The recipe: ``for batch in sifter(loader)``; checkpoint ``sifter.state_dict()``; resume
    with ``sifter.load_state_dict(state)`` and ``sifter(loader)`` on a new loader."""

    def __init__(self, make_loader, model=None, **kw):
        self.loader = make_loader()
        self.sifter = make_sifter(model, **kw)

    def start(self):
        return self.sifter(self.loader)

    def state(self):
        return self.sifter.state_dict()

    def resume(self, state):
        self.sifter.load_state_dict(state)
        assert self.sifter.resume_from is None  # the tracked loader is repositioned by the stage
        return self.sifter(self.loader)

    def close(self):
        # a run abandoned mid-epoch: stop its workers now (left to the garbage collector, torch
        # waits up to 5 s per worker for them to exit)
        self.sifter.close()
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def map_style_loader():
    return StatefulDataLoader(
        Samples(), batch_size=24, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize("output_batch", [None, 16])
def test_map_style_dataset_with_two_workers_resumes_exactly(output_batch):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    reference = check_save_load(
        lambda: LoaderAdapter(map_style_loader, model, output_batch=output_batch), [0, 1, 4, 7]
    )
    kept = output_keys(reference)
    assert len(set(kept)) == len(kept) and set(kept) < set(ALL_KEYS)


def test_the_checkpoint_holds_the_loader_state():
    adapter = LoaderAdapter(map_style_loader)
    it = adapter.start()
    for _ in range(3):
        next(it)
    state = roundtrip(adapter.state())
    adapter.close()
    # the loader's own state, as it was before the micro-batch the sifter had not finished
    assert set(state["source"]) == {"_snapshot", "_steps_since_snapshot", "_iterator_finished"}
    assert state["consumed"] == 3 and state["pending"] == []


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdl")
    return write_shards(
        synthetic_classification(N, dim=6), str(root / "train"), samples_per_shard=60, progress=False
    )


def test_a_webdataset_pipeline_under_a_stateful_dataloader_resumes_exactly(shards):
    def to_xy(s):
        return {"__key__": s["__key__"], "x": torch.from_numpy(s["x.npy"]), "y": s["cls"]}

    def make_loader():
        dataset = (
            WebDataset(shards.pattern, shardshuffle=False)
            .decode()
            .map(to_xy)
            .batched(20, collation_fn=default_collate)
        )
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fast-forward.*")
        reference = check_save_load(lambda: LoaderAdapter(make_loader), [0, 2, 5, 9])
    kept = output_keys(reference)
    assert len(set(kept)) == len(kept) and set(kept) < set(ALL_KEYS)


def shuffled_loader(num_workers, via):
    if via == "sampler":  # the sampler draws from its own generator
        return StatefulDataLoader(
            Samples(),
            batch_size=24,
            sampler=StatefulRandomSampler(range(N), generator=torch.Generator().manual_seed(0)),
            num_workers=num_workers,
        )
    return StatefulDataLoader(
        Samples(),
        batch_size=24,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),
    )


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("via", ["sampler", "shuffle"])
def test_a_checkpoint_between_epochs_restores_the_loaders_next_epoch(num_workers, via):
    """The most common checkpoint, at the end of an epoch: the resumed epoch must follow the
    loader's next shuffle order, not repeat the first one."""
    loader, sifter = shuffled_loader(num_workers, via), make_sifter()
    first = output_keys(sifter(loader))
    state = roundtrip(sifter.state_dict())
    assert not state["pass_open"] and state["source"] is not None
    second = output_keys(sifter(loader))
    assert second != first

    sifter_b = make_sifter()
    sifter_b.load_state_dict(state)
    resumed = output_keys(sifter_b(shuffled_loader(num_workers, via)))
    assert sifter_b.epoch == sifter.epoch == 1
    if via == "shuffle" and num_workers == 0:
        # torchdata 0.11's own quirk: a single-process loader whose sampler shares the loader's
        # generator draws its base seed from it too, and a restored one skips that draw, so its
        # next epoch differs from the uninterrupted loader's even without a sifter. The stage
        # restores it exactly as the loader's load_state_dict does, and never to epoch one's order.
        bare = shuffled_loader(num_workers, via)
        bare.load_state_dict(state["source"])
        order = [k for batch in bare for k in batch["__key__"]]
        assert resumed != first and set(resumed) <= set(order)
        assert resumed == [k for k in order if k in set(resumed)]
    else:
        assert resumed == second
    # a plain source where the checkpoint tracked a loader would silently lose that order
    sifter_c = make_sifter()
    sifter_c.load_state_dict(state)
    with pytest.raises(sp.ResumeError, match="holds the source's position"):
        sifter_c([batch for batch in shuffled_loader(0, via)])


def test_track_source_false_resumes_a_tracked_checkpoint_from_consumed():
    def loader():
        return StatefulDataLoader(Samples(), batch_size=24, num_workers=0)

    reference = output_keys(make_sifter()(loader()))
    s = make_sifter()
    it = s(loader())
    head = output_keys([next(it) for _ in range(3)])
    state = roundtrip(s.state_dict())
    assert state["source"] is not None
    t = make_sifter(track_source=False)
    t.load_state_dict(state)
    assert t.resume_from == state["consumed"]
    tail = output_keys(t(list(loader())[state["consumed"] :]))
    assert head + tail == reference


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_after_an_abandoned_epoch_restores_the_loaders_next_epoch(num_workers):
    """Leaving an epoch early (``break``, EqualSteps' last step) and checkpointing then: in this
    process the next pass is the loader's next epoch, and so it is after a restart."""
    loader, sifter = shuffled_loader(num_workers, "sampler"), make_sifter()
    for i, _ in enumerate(sifter(loader)):
        if i == 2:
            break
    state = roundtrip(sifter.state_dict())
    assert not state["pass_open"] and state["source_abandoned"]
    expected = output_keys(sifter(loader))

    sifter_b = make_sifter()
    sifter_b.load_state_dict(state)
    assert output_keys(sifter_b(shuffled_loader(num_workers, "sampler"))) == expected


def test_a_pass_opened_and_dropped_unread_leaves_the_loader_where_it_was():
    bare, loader = shuffled_loader(0, "sampler"), shuffled_loader(0, "sampler")
    bare_orders = [[k for b in bare for k in b["__key__"]] for _ in range(2)]
    sifter = sp.Sifter(
        None, lambda m, b: b["x"].pow(2).sum(1).double(), sp.Uniform(1.0), batched=True, micro_batch=None
    )
    first = output_keys(sifter(loader))
    sifter(loader)  # opened, never read
    second = output_keys(sifter(loader))
    assert [first, second] == bare_orders and sifter.epoch == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_after_the_last_batch_of_an_epoch_resumes_into_the_next(num_workers):
    """Taken after the epoch's last output but before the loop asked for more (the loader has
    ended, the short last batch comes after it): the resumed pass ends at once, and the next one
    is the loader's next epoch."""
    loader, sifter = shuffled_loader(num_workers, "sampler"), make_sifter(output_batch=10)
    it = sifter(loader)
    outputs = list(it)
    assert len(outputs[-1]["__key__"]) < 10
    sifter_a, loader_a = make_sifter(output_batch=10), shuffled_loader(num_workers, "sampler")
    it_a = sifter_a(loader_a)
    for _ in range(len(outputs)):
        next(it_a)
    state = roundtrip(sifter_a.state_dict())
    assert state["pass_open"] and state["ended"]
    expected = output_keys(sifter(loader))

    sifter_b, loader_b = make_sifter(output_batch=10), shuffled_loader(num_workers, "sampler")
    sifter_b.load_state_dict(state)
    assert list(sifter_b(loader_b)) == []
    assert output_keys(sifter_b(loader_b)) == expected


@pytest.mark.parametrize("hold", [0, 2])
def test_a_second_checkpoint_taken_while_the_resumed_pass_holds_re_read_samples_resumes_exactly(hold):
    """Found by review: the groups a resumed pass re-reads carried no source state, so a
    checkpoint taken while one of them was still pending (the first output batches after a
    resume) held no loader state: resuming from it restarted the loader at its epoch's start
    (ResumeError with keys; wrong data, silently, without). Each re-read group now keeps the
    loader's state from before it, as a group read afresh does; with hold (state_dict(held=)),
    the held batches reach back into the re-read groups all the more."""

    def loader():
        dataset = Samples()
        sampler = StatefulRandomSampler(dataset, generator=torch.Generator().manual_seed(0))
        return StatefulDataLoader(dataset, batch_size=None, sampler=sampler)

    def stage():
        return sp.Sifter(None, lambda m, b: b["x"].pow(2).sum(1).double(), sp.RelativeProbabilistic(1.0, 64),
                         micro_batch=32, output_batch=5, seed=2, hold=hold)  # fmt: skip

    def keys(batch):
        return tuple(batch["__key__"])

    expected = [keys(b) for b in stage()(loader())]
    for cut in (4, 5, 7, 11):
        got = []
        s = stage()
        for batch in s(loader()):
            got.append(keys(batch))
            if len(got) == cut:
                first = roundtrip(s.state_dict())
                break
        s.close()
        s = stage()
        s.load_state_dict(first)
        for batch in s(loader()):
            got.append(keys(batch))
            if len(got) == cut + 1 + hold:  # one batch (and those a prefetcher would hold) later
                second = roundtrip(s.state_dict(held=hold))
                break
        s.close()
        del got[len(got) - hold :]  # held: never trained, handed on again after the resume
        assert second["source"] is not None, cut
        s = stage()
        s.load_state_dict(second)
        got += [keys(b) for b in s(loader())]
        assert got == expected, cut


@pytest.mark.parametrize("early", [False, True], ids=["after_a_whole_epoch", "after_a_left_epoch"])
def test_a_pass_opened_unread_and_resumed_reads_its_own_epochs_shard_order(tmp_path, early):
    """A checkpoint taken right after sifter(loader) opened the next pass, before its first batch,
    over a shuffled ShardSource read by fresh (non-persistent) workers: the resumed pass read
    epoch 0's shard order, the restored loader state being the last epoch's, so the source the
    workers copy was never told the epoch (found by review, 2026-12-05)."""
    from siftpipe.nodes import ShardSource
    from tests.adapters.test_compat_torchdata import NodeDataset  # docs/streaming.md's wrapper

    urls = write_shards(
        synthetic_classification(60, dim=2, seed=3), str(tmp_path / "s"), samples_per_shard=10,
        progress=False,
    ).urls  # fmt: skip

    def make():
        stage = sp.Sifter(
            None, lambda m, items: torch.zeros(len(items), dtype=torch.float64), sp.Uniform(1.0),
            micro_batch=10, collate_fn=list, seed=0,
        )  # fmt: skip
        data = NodeDataset(ShardSource(urls, shuffle=True, seed=2))
        return stage, StatefulDataLoader(data, batch_size=None, num_workers=2)

    def shard_order(items):
        seen = []
        for sample in items:
            if sample["__url__"] not in seen:
                seen.append(sample["__url__"])
        return seen

    stage, loader = make()
    passing = stage(loader)
    for i, _ in enumerate(passing):
        if early and i == 7:
            break
    del passing
    passing = stage(loader)  # epoch 1 opened, nothing read yet
    state = roundtrip(stage.state_dict())
    uninterrupted = shard_order(passing)
    assert uninterrupted == ShardSource(urls, shuffle=True, seed=2).order(1)
    again, loader = make()
    again.load_state_dict(state)
    assert shard_order(again(loader)) == uninterrupted
