"""Sifting on every rank: real processes, gloo backend, each test bounded in time."""

import collections
import gc
import os
import shutil
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import siftpipe as sp
from tests.common import REPO, loss_field, make_samples, roundtrip


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, world, *args, timeout=90, entry=None):
    """Run ``fn(rank, world, port, *args)`` in ``world`` real processes; fail on a hang or error.
    ``entry``: how each process starts (default: with torchrun's environment, ``_entry``)."""
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=entry or _entry, args=(fn, r, world, port, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, f"{len(hung)} rank(s) hung for {timeout} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _entry(fn, rank, world, port, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # a DDP wrapper keeps the group's gloo threads alive into the interpreter's teardown, where one
    # aborted a finished rank (below): no teardown
    sp.exit_process(0)


def _bare_entry(fn, rank, world, port, args):
    """An ``mp.spawn`` job's start: no $RANK or $WORLD_SIZE, the ranks given to
    ``init_process_group``, which ``fn`` calls itself (so that it can make things before it)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    fn(rank, world, port, *args)
    dist.destroy_process_group()


def _equal_steps(rank, world, out_dir):
    # rank r sees a different number of samples and keeps a different number of them
    samples = make_samples(300 + 137 * rank, seed=rank)
    sifter = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(1.0 + rank, 100), micro_batch=20, output_batch=16
    )
    steps = sp.EqualSteps(sifter(samples))
    counts = []
    for _epoch in range(2):
        n = 0
        for _batch in steps:
            t = torch.ones(1)
            dist.all_reduce(t)  # what DDP does every step: a hang here if ranks fall out of step
            n += 1
        counts.append(n)
        steps.source = sifter(samples)
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.array([*counts, steps.discarded]))


def test_equal_steps_keeps_ranks_in_step(tmp_path):
    launch(_equal_steps, 3, str(tmp_path))
    rows = [np.load(tmp_path / f"rank{r}.npy") for r in range(3)]
    assert rows[0][:2].tolist() == rows[1][:2].tolist() == rows[2][:2].tolist()
    assert rows[0][0] > 0 and sum(r[2] for r in rows) > 0  # someone had more and dropped its extra batch


def _sync(rank, world, out_dir):
    # rank 1's losses are 10x rank 0's. With local histories both would keep 1/(1+beta) = 1/3; against
    # the merged history rank 0's losses sit in its lower half (keep ~E[(U/2)^2] = 0.08) and rank 1's
    # in its upper half (keep ~E[((1+U)/2)^2] = 0.58)
    rng = np.random.default_rng(rank)
    samples = make_samples(4000, seed=rank)
    for x, loss in zip(samples, rng.exponential(size=4000) * (10.0**rank)):
        x["loss"] = float(loss)
    sifter = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(2.0, 500), micro_batch=50, output_batch=10, delay=500
    )
    steps = sp.EqualSteps(sifter(samples), sifter=sifter, sync_every=5)
    for _ in steps:
        pass
    state = sifter.state_dict()
    np.save(
        os.path.join(out_dir, f"rank{rank}.npy"),
        np.array([sifter.stats.kept, sifter.stats.seen, int("reference" in state["policy"])]),
    )


def test_global_history_makes_percentiles_global(tmp_path):
    launch(_sync, 2, str(tmp_path))
    low, high = (np.load(tmp_path / f"rank{r}.npy") for r in range(2))
    assert low[2] == high[2] == 1  # the reference is part of the state
    # beyond the warm-up, rank 0 (small losses) keeps far less than rank 1 (large losses)
    assert (low[0] - 500) / (low[1] - 500) < 0.2 and (high[0] - 500) / (high[1] - 500) > 0.45


def _sync_resumed(rank, world, out_dir):
    # rank 1's losses are 10x rank 0's, so the merged reference moves decisions on both ranks:
    # a sync at another step than in the uninterrupted run shows in what is kept
    rng = np.random.default_rng(rank)
    losses = rng.exponential(size=600) * 10.0**rank
    data = [{"__key__": f"r{rank}-{i:05d}", "loss": float(x)} for i, x in enumerate(losses)]

    def make():
        return sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 200), micro_batch=20,
                         output_batch=10, delay=100, seed=0)  # fmt: skip

    sifter = make()
    equal = sp.EqualSteps(sifter(data), sifter=sifter, sync_every=5)
    full = [b["__key__"] for b in equal]
    full_steps, full_kept = equal.steps, sifter.stats.kept
    sifter, got = make(), []
    for step, batch in enumerate(sp.EqualSteps(sifter(data), sifter=sifter, sync_every=5), 1):
        got.append(batch["__key__"])
        if step == 7:  # between two syncs
            state = roundtrip(sifter.state_dict())
            break
    sifter = make()
    sifter.load_state_dict(state)
    equal = sp.EqualSteps(sifter(data[sifter.resume_from or 0 :]), sifter=sifter, sync_every=5)
    got += [b["__key__"] for b in equal]
    np.save(
        os.path.join(out_dir, f"rank{rank}.npy"),
        np.array([got == full, equal.steps, full_steps, sifter.stats.kept, full_kept]),
    )


def test_a_resume_between_two_syncs_syncs_where_the_uninterrupted_run_did(tmp_path):
    """The sync schedule counts steps from the start of the pass, also across a mid-pass
    resume (before, a resumed EqualSteps counted from 0: other syncs, other decisions)."""
    launch(_sync_resumed, 2, str(tmp_path))
    for r in range(2):
        same, steps, full_steps, kept, full_kept = np.load(tmp_path / f"rank{r}.npy").tolist()
        assert same and steps == full_steps > 7 and kept == full_kept


def _seeds_and_audit(rank, world, root):
    log = sp.AuditLog(root, flush_every=100)  # run id shared from rank 0 in the constructor
    sifter = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=25, audit=log)
    assert sifter.rng_seed == [0, rank]
    samples = make_samples(400)  # the same samples on both ranks: the draws must still differ
    kept = [x["__key__"] for x in sifter(samples)]
    sifter.close()
    with open(os.path.join(root, f"kept{rank}.txt"), "w") as f:
        f.write("\n".join(kept))


def test_ranks_draw_independently_and_log_their_own_partitions(tmp_path):
    launch(_seeds_and_audit, 2, str(tmp_path))
    kept = [(tmp_path / f"kept{r}.txt").read_text().split() for r in range(2)]
    assert kept[0] != kept[1]
    table = sp.read_log(str(tmp_path))
    assert len(set(table.column("run").to_pylist())) == 1
    assert sorted(set(table.column("rank").to_pylist())) == [0, 1]
    report = sp.verify_log(str(tmp_path))
    assert report.ok and [s.records for s in report.streams] == [400, 400]
    # what-if reproduces each rank with its own generator
    assert sp.whatif(str(tmp_path), [sp.Uniform(0.5)])[0].flips == 0
    # a rank's whole folder gone: the manifests say the run had 2 processes, so it is missed
    (run_dir,) = tmp_path.glob("run=*")
    shutil.rmtree(run_dir / "rank=1")
    report = sp.verify_log(str(tmp_path))
    assert not report.ok and [(s.rank, s.ok) for s in report.streams] == [(0, True), (1, False)]
    assert "rank 1 left nothing in the log" in report.streams[1].missing_parts[0]
    assert sp.verify_log(str(tmp_path), rank=0).complete  # asked for rank 0 only


def _prefetched(batches, depth):
    """A same-thread prefetcher reading ``depth`` batches ahead and copying each (as one that
    moves batches to the GPU does): the batch the consumer discards is not the stage's last."""
    ahead: collections.deque = collections.deque()
    for batch in batches:
        ahead.append({k: (v.clone() if isinstance(v, torch.Tensor) else list(v)) for k, v in batch.items()})
        if len(ahead) > depth:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()


def _discarded_batch_audit(rank, world, root, batched, prefetch=0):
    # rank 1 has more data, so its pass ends with a batch fetched for a step rank 0 cannot take
    log = sp.AuditLog(root, flush_every=50)
    samples = make_samples(120 + 80 * rank, seed=rank)
    for x in samples:
        x["__key__"] = f"r{rank}-{x['__key__']}"
    data = samples
    if batched:
        data = [
            {"__key__": [x["__key__"] for x in chunk], "loss": torch.tensor([x["loss"] for x in chunk])}
            for chunk in (samples[i : i + 40] for i in range(0, len(samples), 40))
        ]
    sifter = sp.Sifter(
        None, loss_field, sp.Uniform(0.75), micro_batch=None if batched else 40, output_batch=None
        if batched else 10, batched=batched, audit=log, seed=3,
    )  # fmt: skip
    trained, discarded = [], 0
    for _epoch in range(2):
        equal = sp.EqualSteps(_prefetched(sifter(data), prefetch), sifter=sifter)
        for batch in equal:
            trained += list(batch["__key__"])
        discarded += equal.discarded
    sifter.close()
    with open(os.path.join(root, f"trained{rank}.txt"), "w") as f:
        f.write("\n".join(trained))
    np.save(
        os.path.join(root, f"rank{rank}.npy"),
        np.array([discarded, sifter.stats.kept, sifter.stats.unhanded, len(trained)]),
    )


@pytest.mark.parametrize("batched, prefetch", [(False, 0), (True, 0), (False, 1), (True, 2)])
def test_a_batch_equal_steps_discards_reads_as_not_kept(tmp_path, batched, prefetch):
    """Found by a session's note: the batch EqualSteps fetched for a step no rank takes (the one
    that ends the epoch on a rank with more data) was recorded as kept, so read_log and replay
    listed never-trained samples as trained. Given the sifter, it is noted as never handed on;
    with a prefetcher between them, so are the batches it read after that one (before, the
    stage noted its own last batch, and the discarded one read as kept)."""
    launch(_discarded_batch_audit, 2, str(tmp_path), batched, prefetch)
    trained = {r: (tmp_path / f"trained{r}.txt").read_text().split() for r in range(2)}
    discarded, kept, unhanded, n = np.load(tmp_path / "rank1.npy").tolist()
    assert discarded == 2 and unhanded > 0 and kept == n + unhanded  # one batch per epoch
    assert np.load(tmp_path / "rank0.npy").tolist()[0] == 0
    table = sp.read_log(str(tmp_path))
    for r in range(2):
        mine = [k for k, rank, keep in zip(*(table.column(c).to_pylist() for c in ("key", "rank", "kept")))
                if rank == r and keep]  # fmt: skip
        assert sorted(mine) == sorted(trained[r])
    report = sp.verify_log(str(tmp_path))
    assert report.ok and f"{int(unhanded)} records decided kept were never handed on" in "\n".join(
        report.lines()
    )


def _stream_discard(rank, world, out_dir):
    from siftpipe.integrations._common import SiftedStream

    samples = make_samples(60 + 40 * rank, seed=rank)

    def open_pass(epoch, skip):
        return [samples[i : i + 10] for i in range(skip, len(samples), 10)], skip

    sifter = sp.Sifter(None, loss_field, sp.Uniform(0.8), micro_batch=10, output_batch=5, seed=1)
    stream = SiftedStream(sifter, open_pass, endless=False, lockstep=True)
    for _batch in stream:  # epoch 0: every batch the trainer gets, it trains
        stream.ack()
    it = iter(stream)
    next(it)  # epoch 1: the first batch, trained
    stream.ack()
    state = stream.state_dict()
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.array([stream.discarded, len(state["unacked"])]))


def test_a_batch_equal_steps_discards_is_not_replayed_by_the_trainer_stream(tmp_path):
    """Found by review: the trainer integrations' stream counted the discarded batch as handed to
    the trainer and awaiting its ack, so every later ack acknowledged the batch before the one
    trained, and a checkpoint then replayed a batch already trained."""
    launch(_stream_discard, 2, str(tmp_path))
    rows = [np.load(tmp_path / f"rank{r}.npy").tolist() for r in range(2)]
    assert rows[1][0] == 1 and rows[0][0] == 0  # the rank with more data discarded a batch
    assert rows[0][1] == rows[1][1] == 0  # everything fetched was trained: nothing to replay


def _stream_discard_after_resume(rank, world, out_dir):
    from siftpipe.integrations._common import SiftedStream

    samples = make_samples(60 + 40 * rank, seed=rank)

    def open_pass(epoch, skip):
        return [samples[i : i + 10] for i in range(skip, len(samples), 10)], skip

    def stage():
        return sp.Sifter(None, loss_field, sp.Uniform(0.8), micro_batch=10, output_batch=5, seed=1)

    stream = SiftedStream(stage(), open_pass, endless=False, lockstep=True)
    it = iter(stream)
    next(it)
    stream.ack()
    next(it)  # fetched ahead by the trainer, not trained when the checkpoint is taken
    state = stream.state_dict()
    sifter = stage()
    resumed = SiftedStream(sifter, open_pass, endless=False, lockstep=True)
    resumed.load_state_dict(state)
    trained = 0
    for _batch in resumed:  # the replayed batch first, then the stage's
        resumed.ack()
        trained += 1
    np.save(
        os.path.join(out_dir, f"rank{rank}.npy"),
        np.array([len(state["unacked"]), trained, resumed.discarded, sifter.stats.unhanded]),
    )


def test_a_resumed_trainer_stream_takes_back_the_stages_batch_not_a_replayed_one(tmp_path):
    """Found by review: a resumed trainer stream replays the batch its checkpoint's trainer had not
    trained before it reads the stage; EqualSteps counted it among the stage's batches, so at the
    epoch's end the stage refused the discard (SiftError: the consumer read one batch more than
    it handed on) and the rank with more data failed."""
    launch(_stream_discard_after_resume, 2, str(tmp_path))
    rows = [np.load(tmp_path / f"rank{r}.npy").tolist() for r in range(2)]
    assert rows[0][0] == rows[1][0] == 1  # each checkpoint held one batch to replay
    assert rows[0][2] == 0 and rows[1][2] == 1  # the rank with more data discarded one batch
    assert rows[1][3] > 0  # and the stage noted it (with the rest of its input) as not handed on


def test_fixed_steps_and_single_process_fallback():
    stream = iter(range(10))
    assert list(sp.fixed_steps(stream, 4)) == [0, 1, 2, 3]
    with pytest.raises(sp.SiftError, match="ended after 6 of 10 steps"):
        list(sp.fixed_steps(stream, 10))
    assert list(sp.EqualSteps([1, 2, 3])) == [1, 2, 3]  # no process group: a plain pass-through
    with pytest.raises(sp.ConfigError, match="sync_every needs"):
        sp.EqualSteps([1], sync_every=3)


def test_equal_steps_in_one_process_counts_its_steps_and_keeps_them_in_the_sifters_state():
    # found by review: without a process group it yielded everything but said steps == 0, and a
    # mid-pass checkpoint's pass_steps stayed 0
    data = make_samples(100, seed=5)
    assert sp.EqualSteps(iter(range(5))).steps == 0
    plain = sp.EqualSteps(iter(range(5)))
    assert list(plain) == [0, 1, 2, 3, 4] and plain.steps == 5
    sifter = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=10, output_batch=10)
    equal = sp.EqualSteps(sifter(data), sifter=sifter)
    it = iter(equal)
    for _ in range(3):
        next(it)
    state = roundtrip(sifter.state_dict())
    assert equal.steps == 3 and state["steps"] == 3
    again = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=10, output_batch=10)
    again.load_state_dict(state)
    resumed = sp.EqualSteps(again(data[again.resume_from or 0 :]), sifter=again)
    assert len(list(resumed)) == 7 and resumed.steps == 10


def _prefetched(batches, depth):
    """What a prefetcher does: hands on each batch once ``depth`` more are read."""
    ahead = collections.deque()
    for batch in batches:
        ahead.append(batch)
        if len(ahead) > depth:
            yield ahead.popleft()
    yield from ahead


@pytest.mark.parametrize("around", [True, False])
def test_a_state_held_behind_a_prefetcher_resumes_the_step_count_of_the_steps_trained(around):
    """state_dict(held=k) behind a prefetcher around EqualSteps: EqualSteps had counted the held
    batches, and the state kept that count while resuming before them, so the resumed steps ran
    k ahead (sync_every's syncs fell elsewhere: the ranks trained other samples; found by review,
    2026-12-05). A prefetcher between the stage and EqualSteps: nothing to take back."""
    data = make_samples(400, seed=1)

    def make():
        return sp.Sifter(
            None, loss_field, sp.RelativeProbabilistic(1.0, 100), micro_batch=32, output_batch=16,
            hold=2, seed=5,
        )  # fmt: skip

    def steps(sifter, source):
        # (the prefetcher around EqualSteps, or between it and the stage)
        if around:
            equal = sp.EqualSteps(sifter(source), sifter=sifter)
            return equal, _prefetched(equal, 2)
        equal = sp.EqualSteps(_prefetched(sifter(source), 2), sifter=sifter)
        return equal, equal

    ref = make()
    equal, batches = steps(ref, data)
    expected = [list(b["__key__"]) for b in batches]
    full_steps = equal.steps
    sifter = make()
    trained = []
    for batch in steps(sifter, data)[1]:
        trained.append(list(batch["__key__"]))
        if len(trained) == 5:
            state = roundtrip(sifter.state_dict(held=2))
            break
    assert state["steps"] == 5
    again = make()
    again.load_state_dict(state)
    equal, batches = steps(again, data[again.resume_from or 0 :])
    assert trained + [list(b["__key__"]) for b in batches] == expected
    assert equal.steps == full_steps == len(expected)


def _no_forward(model, batch):
    raise AssertionError("the recipe never runs a scoring forward")


class _Indexed(torch.utils.data.Dataset):
    """401 samples keyed by their index (DistributedSampler pads 2 ranks to 402: one sample twice)."""

    def __len__(self):
        return 401

    def __getitem__(self, i):
        return {"__key__": i, "x": torch.tensor([float(i)])}


def _training_loss(keys):
    # what the training step would hand back: every other sample easy, the rest hard
    k = keys.double()
    return torch.where(k % 2 == 0, 0.05 + k / 4000, 1.0 + k / 400)


def _memory_shared(rank, world, out_dir, share):
    from torch.utils.data import DataLoader, DistributedSampler

    data = _Indexed()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    sifter = sp.recipe(None, _no_forward, budget=3 * len(sampler), batched=True, micro_batch=None,
                       seed=0, cost_guard=False)  # fmt: skip
    unknown, merged = [], []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        sifter.set_epoch(epoch)
        before = sifter.stats.unknown
        equal = sp.EqualSteps(sifter(loader), sifter=sifter, sync_memory=share)
        for batch in equal:
            t = torch.ones(1)
            dist.all_reduce(t)  # DDP's step
            sifter.observe(batch["__key__"], _training_loss(batch["__key__"]))
        unknown.append(sifter.stats.unknown - before)
        merged.append(equal.merged)
    state = sifter.memory.state_dict()
    order = np.argsort(state["keys"].numpy())
    np.savez(
        os.path.join(out_dir, f"rank{rank}.npz"),
        unknown=np.array(unknown),
        merged=np.array(merged),
        keys=state["keys"].numpy()[order],
        loss=state["loss"].numpy()[order],
        epoch=state["epoch"].numpy()[order],
    )


@pytest.mark.parametrize("share", [None, False])
def test_a_shared_memory_knows_every_sample_a_distributed_sampler_deals_to_this_rank(tmp_path, share):
    """DistributedSampler(shuffle=True) deals samples to ranks anew each epoch: with the memory
    shared at each epoch's end (EqualSteps' default when the sifter has one) every sample a rank
    meets after the first epoch is known; kept local, about half are unknown and kept unsifted."""
    launch(_memory_shared, 2, str(tmp_path), share)
    runs = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for run in runs:
        assert run["unknown"][0] == 201  # the first epoch: nothing known yet
        if share is None:
            assert run["unknown"][1:].tolist() == [0, 0] and run["merged"][0] == 201
        else:
            # about half of epoch 1's samples were trained on the other rank; fewer by epoch 2
            assert run["unknown"][1] > 60 and run["unknown"][2] > 20 and run["keys"].size < 401
            assert run["merged"].tolist() == [0, 0, 0]
    if share is None:
        # every rank holds the same entries: all 401 samples, the padded one once
        assert runs[0]["keys"].size == 401
        for name in ("keys", "loss", "epoch"):
            assert runs[0][name].tolist() == runs[1][name].tolist()


def test_sync_memory_outside_a_process_group_and_without_a_memory():
    sifter = sp.recipe(None, _no_forward, budget=10)
    sifter.memory.update_keys(["a"], np.array([1.0]), 0, 1)
    assert sp.sync_memory(sifter) == 0 and sifter.memory.changes()[0].size == 1  # nothing sent
    with pytest.raises(sp.ConfigError, match="score memory"):
        sp.sync_memory(sp.Sifter(None, loss_field, sp.Uniform(0.5)))
    with pytest.raises(sp.ConfigError, match="sync_memory needs"):
        sp.EqualSteps([1], sifter=sp.Sifter(None, loss_field, sp.Uniform(0.5)), sync_memory=True)


def _memory_full(rank, world, out_dir):
    import warnings

    memory = sp.ScoreMemory(150, max_age=None)
    caught = []
    for epoch in range(2):
        keys = np.arange(rank * 1000, rank * 1000 + 100)  # the same samples each epoch
        memory.update_keys(keys, np.full(100, 1.0 + epoch), epoch, 1)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            sp.sync_memory(memory)
        caught += [str(w.message) for w in got if issubclass(w.category, sp.ScoreMemoryWarning)]
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.array([len(memory), memory.refused, len(caught)]))
    assert "capacity = the whole dataset's size" in caught[0]


def test_a_shared_memory_too_small_for_every_ranks_samples_refuses_counts_and_warns_once(tmp_path):
    launch(_memory_full, 2, str(tmp_path))
    for r in range(2):
        held, refused, warned = np.load(tmp_path / f"rank{r}.npy").tolist()
        # each epoch: 100 own, and of the other's 100 the 50 that fit (updated in epoch 1) and
        # 50 refused; one warning, not one per epoch
        assert held == 150 and refused == 50 + 50 and warned == 1


def _resync(rank, world, out_dir, retrainer):
    from siftpipe.core.memory import FEEDBACK

    memory = sp.ScoreMemory(100, max_age=None)
    if rank == 0:  # early in epoch 1, on rank 0
        memory.update_keys(["k", "a"], np.array([0.9, 0.5], np.float32), 1, FEEDBACK)
    sp.sync_memory(memory)  # a sync inside the epoch (every so many steps)
    if rank == retrainer:  # k trained again later in the epoch: padding, or sampling with replacement
        memory.update_keys(["k"], np.array([0.1], np.float32), 1, FEEDBACK)
    if rank == 1:  # both ranks train b in the same stretch: the larger loss, on both
        memory.update_keys(["b"], np.array([0.2], np.float32), 1, FEEDBACK)
    if rank == 0:
        memory.update_keys(["b"], np.array([0.7], np.float32), 1, FEEDBACK)
    sp.sync_memory(memory)
    sp.sync_memory(memory)
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), memory.lookup_keys(["k", "a", "b"], 2)[0])


@pytest.mark.parametrize("retrainer", [0, 1])
def test_syncs_inside_an_epoch_leave_every_rank_the_latest_loss(tmp_path, retrainer):
    # before: the rank that did not retrain k kept the stale 0.9 (the larger loss of one epoch won)
    launch(_resync, 2, str(tmp_path), retrainer)
    for r in range(2):
        assert np.load(tmp_path / f"rank{r}.npy").tolist() == pytest.approx([0.1, 0.5, 0.7])


def _halved(stream):
    """Something between the stage and EqualSteps that cuts each batch in two (not allowed)."""
    for b in stream:
        n = len(b["__key__"]) // 2
        yield {k: v[:n] for k, v in b.items()}
        yield {k: v[n:] for k, v in b.items()}


def _discard_fails(rank, world, out_dir):
    n = 32 if rank == 0 else 48  # rank 1 holds a fetched batch when rank 0 runs out
    batches = [
        {"__key__": torch.arange(rank * 1000 + i, rank * 1000 + i + 8), "x": torch.zeros(8, 1)}
        for i in range(0, n, 8)
    ]
    sifter = sp.recipe(None, _no_forward, budget=10_000, batched=True, cost_guard=False, seed=0)
    sifter.set_epoch(0)
    said = ""
    try:
        for b in sp.EqualSteps(_halved(sifter(batches)), sifter=sifter):
            sifter.observe(b["__key__"], torch.ones(len(b["__key__"])))
    except sp.SiftError as e:
        said = str(e)
    # the job goes on (the error caught and logged): the next collective meets every rank
    t = torch.ones(1)
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{t.item()}|{len(sifter.memory)}|{said}")


def test_a_rank_whose_epoch_end_fails_still_takes_part_in_the_memory_sync(tmp_path):
    # before: rank 1 raised before the sync and rank 0 waited in it until the gloo timeout
    launch(_discard_fails, 2, str(tmp_path), timeout=60)
    got = [(tmp_path / f"rank{r}.txt").read_text().split("|") for r in range(2)]
    assert got[0][0] == got[1][0] == "2.0"
    assert got[0][1] == got[1][1]  # both merged each other's losses
    assert got[0][2] == "" and "discard_last(fetched=" in got[1][2]


def _stage_fails_on_one_rank(rank, world, out_dir):
    calls = [0]

    def scorer(model, batch):
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise ValueError("a corrupt sample on rank 1")
        return batch["loss"].double()

    samples = make_samples(200, seed=rank)
    sifter = sp.Sifter(None, scorer, sp.Uniform(0.9), micro_batch=10, output_batch=8)
    steps, said = [0, 0], ""
    try:
        for _ in sp.EqualSteps(sifter(samples), sifter=sifter):
            dist.all_reduce(torch.ones(1))  # the training step's gradient all-reduce
            steps[0] += 1
    except sp.SiftError as e:
        said = f"{type(e).__name__}: {e}"
    # the job goes on (the error caught and logged): the next epoch's collectives meet in step
    sifter.set_epoch(1)
    for _ in sp.EqualSteps(sifter(samples), sifter=sifter):
        t = torch.full((1,), float(rank + 1))
        dist.all_reduce(t)
        steps[1] += 1
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{steps[0]}|{steps[1]}|{t.item()}|{said}")


def test_a_stage_failing_on_one_rank_ends_the_epoch_on_every_rank_at_that_step(tmp_path):
    # found by review: the failing rank left EqualSteps before the step's agreement, so the other
    # rank's agreement was paired with its next collective: epochs out of step, gradients averaged
    # across epochs, or a crash on mismatched tensors
    launch(_stage_fails_on_one_rank, 2, str(tmp_path), timeout=90)
    got = [(tmp_path / f"rank{r}.txt").read_text().split("|") for r in range(2)]
    assert got[0][0] == got[1][0] == "3" and got[0][1] == got[1][1]
    assert got[0][2] == got[1][2] == "3.0"  # the second epoch's all-reduces met each other
    assert got[1][3].startswith("ScorerError") and "a corrupt sample on rank 1" in got[1][3]
    assert got[0][3].startswith("SiftError: another rank's data or stage failed at step 4")


class _ResumeRefused:
    """A loader whose iter() fails, as a torchdata Loader's does when its reset refuses a state."""

    def __iter__(self):
        raise sp.ResumeError("the checkpoint was made with other settings (on rank 1)")


def _iter_fails_on_one_rank(rank, world, out_dir):
    samples = make_samples(40, seed=rank)
    sifter = sp.Sifter(None, loss_field, sp.Uniform(0.9), micro_batch=10, output_batch=8)
    said = ""
    try:
        for _ in sp.EqualSteps(_ResumeRefused() if rank == 1 else sifter(samples), sifter=sifter):
            dist.all_reduce(torch.ones(1))
    except sp.SiftError as e:
        said = f"{type(e).__name__}: {e}"
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)  # the job's next collective meets the other rank's
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{t.item()}|{said}")


def test_a_loader_whose_iter_fails_on_one_rank_is_told_to_every_rank(tmp_path):
    # found by review, 2026-12-05: iter(source) (a Loader's reset, a DataLoader's workers) sat
    # outside the step's agreement: the other rank waited for the process group's timeout (30
    # minutes by default) and never learnt the cause
    launch(_iter_fails_on_one_rank, 2, str(tmp_path), timeout=90)
    got = [(tmp_path / f"rank{r}.txt").read_text().split("|") for r in range(2)]
    assert got[0][0] == got[1][0] == "3.0"
    assert got[1][1].startswith("ResumeError") and "other settings (on rank 1)" in got[1][1]
    assert got[0][1].startswith("SiftError: another rank's data or stage failed at step 1")


def _failure_then_sync_fails(rank, world, out_dir):
    import warnings

    warnings.simplefilter("error", sp.ScoreMemoryWarning)  # a job run with -W error

    def scorer(model, batch):
        if rank == 1 and batch["__key__"][0].startswith("s00040"):
            raise ValueError("a corrupt sample on rank 1")
        return batch["loss"].double()

    samples = make_samples(80, seed=rank)
    for i, s in enumerate(samples):
        s["__key__"] = f"s{i:05d}-r{rank}"
    # too small for both ranks' samples: the epoch-end sync warns, here an error, on both ranks
    sifter = sp.Sifter(
        None, scorer, sp.Uniform(0.9), micro_batch=10, output_batch=8, memory=sp.ScoreMemory(50, max_age=None)
    )
    said = ""
    try:
        for _ in sp.EqualSteps(sifter(samples), sifter=sifter, sync_memory=True):
            dist.all_reduce(torch.ones(1))
    except Exception as e:
        said = f"{type(e).__name__}: {e} || {' '.join(getattr(e, '__notes__', []))}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(said)


def test_a_ranks_own_error_survives_a_memory_sync_that_fails_after_it(tmp_path):
    # found 2026-12-04: the epoch-end memory sync ran in a finally; when it raised too, the
    # failing rank's own error (the one naming the sample) was replaced by the sync's
    launch(_failure_then_sync_fails, 2, str(tmp_path), timeout=90)
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert said[1].startswith("ScorerError") and "a corrupt sample on rank 1" in said[1], said[1]
    assert "ending the epoch after it failed too" in said[1] and "ScoreMemoryWarning" in said[1]
    assert said[0].startswith("ScoreMemoryWarning"), said[0]  # rank 0's own error: the sync's


def _ddp_wrapper_scored(rank, world, out_dir):
    # the DDP wrapper itself given as the Sifter's model, the model with buffers (batch norm),
    # the ranks' data unequal: DDP's forward broadcasts buffers, a collective the ranks would
    # make different numbers of times, paired with EqualSteps' all-reduce: a hang before
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    model = DistributedDataParallel(net)
    g = torch.Generator().manual_seed(rank)
    n = 200 + 150 * rank
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    data = [{"__key__": f"r{rank}-{i}", "x": x[i], "y": int(y[i])} for i in range(n)]
    given = []

    def scorer(m, batch):
        given.append(type(m).__name__)
        return torch.nn.functional.cross_entropy(m(batch["x"]), batch["y"], reduction="none")

    sifter = sp.Sifter(model, scorer, sp.RelativeProbabilistic(1.0, 200), micro_batch=32, output_batch=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for batch in sp.EqualSteps(sifter(data), sifter=sifter):
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    weights = torch.cat([p.detach().flatten() for p in net.parameters()])
    every = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(every, weights)
    assert all(torch.equal(every[0], w) for w in every)
    assert set(given) == {"Sequential"}  # the scorer is given the module DDP wraps
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.array([steps, sifter.stats.micro_batches]))
    # once in a CI run both ranks aborted at exit ("terminate called without an active exception",
    # exit -6) after the test's work was done: the wrapper's reducer keeps the group's gloo threads
    # alive (letting go of it here did not end them), so _entry ends with sp.exit_process


def test_a_ddp_wrapper_given_as_the_model_is_scored_through_its_module_without_a_hang(tmp_path):
    # found 2026-12-05 (fourth session): both ranks timed out in EqualSteps' all-reduce
    launch(_ddp_wrapper_scored, 2, str(tmp_path), timeout=120)
    rows = [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]
    assert rows[0][0] == rows[1][0] > 0 and rows[0][1] != rows[1][1]  # same steps, unequal scoring


def _sharded_scored(rank, world, out_dir):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model)
    sifter = sp.Sifter(model, lambda m, b: m(b["x"]).sum(1), micro_batch=4)
    with pytest.raises(sp.ConfigError, match=r"FSDPModule.*gathers its parameters.*sp.recipe"):
        list(sifter([{"__key__": f"k{i}", "x": torch.randn(4)} for i in range(8)]))
    # its layers sharded one by one, the root not (review of the first fix: scored, unrefused)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(layers[0])
    fully_shard(layers[1])
    sifter = sp.Sifter(layers, lambda m, b: m(b["x"]).sum(1), micro_batch=4)
    with pytest.raises(sp.ConfigError, match=r"model \(Sequential\) is sharded \(FSDPModule, in its module"):
        list(sifter([{"__key__": f"k{i}", "x": torch.randn(4)} for i in range(8)]))
    # a scorer written for a DDP wrapper (m.module(x)) is told it is given the module
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
    sifter = sp.Sifter(ddp, lambda m, b: m.module(b["x"]).sum(1), micro_batch=4)
    with pytest.raises(sp.ScorerError, match=r"given the module DistributedDataParallel wraps"):
        list(sifter([{"__key__": f"k{i}", "x": torch.randn(4)} for i in range(8)]))
    # compiled after wrapping (torch.compile(DDP(m))): scored through the module too (review)
    given = []
    compiled = torch.compile(ddp, backend="eager")
    sifter = sp.Sifter(compiled, lambda m, b: given.append(m) or m(b["x"]).sum(1), micro_batch=4)
    list(sifter([{"__key__": f"k{i}", "x": torch.randn(4)} for i in range(8)]))
    assert given and all(m is ddp.module for m in given)
    # a model set to None afterwards is not held by the stage (review: kept alive)
    import weakref

    held = weakref.ref(compiled)
    sifter.model = None
    sifter.scorer = lambda m, b: b["x"].sum(1)
    list(sifter([{"__key__": f"k{i}", "x": torch.randn(4)} for i in range(8)]))
    given.clear()
    del compiled
    gc.collect()
    assert held() is None
    # with no scoring forward (losses handed back), a sharded model is no trouble
    recipe = sp.recipe(model, "cross_entropy", budget=16, batched=False, micro_batch=4)
    assert len(list(recipe([{"__key__": f"k{i}", "x": torch.randn(4)} for i in range(8)]))) == 8


def test_a_sharded_model_is_refused_for_a_scoring_forward_not_for_feedback(tmp_path):
    launch(_sharded_scored, 1, str(tmp_path))


def _log_made_before_init(rank, world, port, out_dir):
    import warnings

    with warnings.catch_warnings(record=True) as made:
        warnings.simplefilter("always")
        log = sp.AuditLog(out_dir, flush_every=50, writer="thread")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with warnings.catch_warnings(record=True) as used:
        warnings.simplefilter("always")
        s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=20, audit=log)
        list(s(make_samples(60, seed=rank)))
        s.close()
    said = [str(w.message) for w in made + used if "run of its own" in str(w.message)]
    assert not made and len(said) == 1 and log.run_id in said[0], said


def test_an_audit_log_made_before_init_in_a_spawned_job_says_each_rank_writes_its_own_run(tmp_path):
    # found 2026-12-05 (fourth session): with no $WORLD_SIZE (an mp.spawn job) nothing was said,
    # and verify then reported each run missing the other ranks' streams
    launch(_log_made_before_init, 2, str(tmp_path / "log"), entry=_bare_entry)
    assert len(list((tmp_path / "log").glob("run=*"))) == 2


def _synced_log(rank, world, root, sync_every):
    rng = np.random.default_rng(rank)
    losses = rng.exponential(size=400) * 10.0**rank
    data = [{"__key__": f"r{rank}-{i:05d}", "loss": float(x)} for i, x in enumerate(losses)]
    log = sp.AuditLog(root, flush_every=100, run_id="job", writer="thread")
    s = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(1.0, 200), micro_batch=20, output_batch=10, audit=log
    )
    for _ in sp.EqualSteps(s(data), sifter=s, sync_every=sync_every):
        pass
    s.close()


def test_whatif_says_when_the_run_decided_against_histories_merged_across_ranks(tmp_path):
    # found 2026-12-05 (fourth session): the logged policy re-run flipped 143 of a complete log's
    # decisions with sync_every, unsaid, where docs/audit.md calls zero flips a completeness check
    import warnings

    for sync_every in (None, 5):
        root = str(tmp_path / f"log{sync_every}")
        launch(_synced_log, 2, root, sync_every)
        assert sp.verify_log(root).complete
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            (result,) = sp.whatif(root, [sp.RelativeProbabilistic(1.0, 200)])
        merged = [w for w in said if "merged across ranks" in str(w.message)]
        if sync_every is None:
            assert result.flips == 0 and not merged
        else:
            assert result.flips > 0 and len(merged) == 1


def _short_epochs_and_breaks(rank, world, out_dir):
    import warnings

    rng = np.random.default_rng(rank)
    sifter = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 200), micro_batch=20,
                       output_batch=10, delay=20, seed=1)  # fmt: skip
    rates = []
    for epoch in range(6):
        n, scale = (300, 10.0) if epoch == 0 else (80, 1.0)  # then the model has learned
        losses = rng.exponential(size=n) * scale
        data = [{"__key__": f"e{epoch}-r{rank}-{i}", "loss": float(x)} for i, x in enumerate(losses)]
        seen, kept = sifter.stats.seen, sifter.stats.kept
        for _ in sp.EqualSteps(sifter(data), sifter=sifter, sync_every=5):
            dist.all_reduce(torch.ones(1))
        rates.append((sifter.stats.kept - kept) / (sifter.stats.seen - seen))
    # a loop leaving each epoch at a step limit: the memory is not shared, and that is said
    memory = sp.recipe(
        None, _no_forward, budget=3000, batched=True, micro_batch=None, seed=0, cost_guard=False
    )
    said = []
    for on_leave in ("warn", "ignore"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            equal = sp.EqualSteps(memory(_keyed_batches(rank)), sifter=memory, on_leave=on_leave)
            for step, batch in enumerate(equal):
                memory.observe(batch["__key__"], _training_loss(batch["__key__"]))
                if step == 3:
                    break
            del equal
        said.append([str(w.message) for w in caught if "left an EqualSteps epoch" in str(w.message)])
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), rates=np.array(rates),
             said=np.array([len(s) for s in said]), text=np.array(said[0] or [""]))  # fmt: skip


def _keyed_batches(rank):
    for b in range(10):
        yield {"__key__": torch.arange(8) + 8 * b + 1000 * rank, "x": torch.zeros(8, 2)}


def test_short_epochs_sync_their_histories_and_a_loop_left_early_says_the_memory_was_not_shared(tmp_path):
    """sync_every counted the steps of each epoch: an epoch of fewer steps never synced, and the
    merged history of the first epoch (losses 10x higher) decided every later one, keeping 6% where
    the ranks' own windows kept 23-49%. A loop leaving each epoch at a step limit shared no memory,
    silently (both found by review, 2026-12-05). Now each epoch decides by each rank's own window
    until its first sync, and the loop left early is warned of (not with on_leave='ignore', a
    trainer's fit ending mid-epoch)."""
    launch(_short_epochs_and_breaks, 2, str(tmp_path))
    for run in (np.load(tmp_path / f"rank{r}.npz") for r in range(2)):
        assert run["rates"][1:].min() > 0.15, run["rates"]
        assert run["said"].tolist() == [1, 0]
        assert "call sp.sync_memory(sifter) on every rank" in str(run["text"][0])


def _seeded_before_init(rank, world, port, out_dir):
    sifter = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=25, seed=0)  # before init
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    state = roundtrip(sifter.state_dict())  # a checkpoint before the first pass
    resumed = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=25, seed=0)
    resumed.load_state_dict(state)
    kept = [x["__key__"] for x in resumed(make_samples(400))]
    with open(os.path.join(out_dir, f"kept{rank}.txt"), "w") as f:
        f.write("\n".join(kept))


def test_a_checkpoint_before_the_first_pass_of_a_stage_made_before_init_keeps_each_ranks_draws(tmp_path):
    """A Sifter made before init_process_group (mp.spawn) draws by its rank from its first pass;
    a checkpoint taken before that saved the shared seed's state, and every rank resumed with the
    same draws, keeping the same samples (found by review, 2026-12-05)."""
    launch(_seeded_before_init, 2, str(tmp_path), entry=_bare_entry)
    kept = [(tmp_path / f"kept{r}.txt").read_text().split() for r in range(2)]
    assert kept[0] != kept[1]


def _script(script: str, *args: str, **kw):
    """Run ``script`` (its ``{repo}`` filled in) in a fresh interpreter whose stdout is
    block-buffered, as a rank's is when torchrun's output goes to a file or a pipe."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if "stdout" not in kw:
        kw["capture_output"] = True
    cmd = [sys.executable, "-c", script.format(repo=str(REPO)), *args]
    return subprocess.run(cmd, text=True, timeout=120, check=False, env=env, **kw)


ENDS = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, {repo!r})
import siftpipe as sp
from tests.common import loss_field, make_samples

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()  # a module global: deleted in the interpreter's teardown
atexit.register(print, "atexit ran")
threading.Thread(target=lambda: (time.sleep(0.5), print("upload done"))).start()  # not a daemon
pool = ThreadPoolExecutor(2)
pool.submit(time.sleep, 0.2)  # never shut down (its threads are not daemons)
notes = open(sys.argv[2], "w")
notes.write("metrics: 42")  # never closed
s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=sys.argv[1])  # left open
for _ in s(make_samples(400, seed=3)):
    pass
sys.stdout.write("unflushed")  # (stdout is a pipe: block-buffered)
{end}
"""


@pytest.mark.parametrize("end", ["sp.exit_process(3)", "sys.exit(3)", "atexit.register(sp.exit_process, 3)"])
def test_exit_process_runs_the_exit_handlers_and_skips_the_teardown(tmp_path, end):
    """DDP on gloo keeps its process group's threads alive into the interpreter's teardown, where
    one aborted finished jobs (SIGABRT, `terminate called without an active exception`: the CI
    run of 2026-12-06, and 5 and 6 of 16 runs of tools/stress_ddp_exit.py under load). exit_process
    ends the process with its status once its other threads that are not daemons end (an
    executor never shut down too: the review of it hung there), its output and files left open
    flushed (lost at first) and its exit handlers run (the audit log left open is closed whole),
    and no teardown; called from an exit handler, once (at first it ran the handlers again and
    again, and the log's close failed at the recursion limit). ``sys.exit`` is the control."""
    log, notes = str(tmp_path / "audit"), tmp_path / "notes.txt"
    done = _script(ENDS.replace("{end}", end), log, str(notes))
    assert done.returncode == 3, done.stderr
    assert "unflushed" in done.stdout and "atexit ran" in done.stdout and "upload done" in done.stdout
    assert ("teardown ran" in done.stdout) == (end == "sys.exit(3)")
    assert notes.read_text() == "metrics: 42"
    report = sp.verify_log(log)
    assert report.ok and [s.records for s in report.streams] == [400], report.lines()


@pytest.mark.parametrize(
    ("code", "status", "said"), [(None, 0, ""), (True, 1, ""), (-1, 255, ""), ("no", 1, "no")]
)
def test_exit_process_reads_its_code_as_sys_exit_does(code, status, said):
    """The review: a code that was not an int raised after the exit handlers had run, and the
    process went on into the teardown the function avoids."""
    script = "import sys; sys.path.insert(0, {repo!r}); import siftpipe as sp; sp.exit_process(%r)"
    done = _script(script % (code,))
    assert done.returncode == status and done.stderr.strip() == said, done.stderr


FORKED = """
import os, sys, tempfile, multiprocessing as mp
sys.path.insert(0, {repo!r})
import siftpipe as sp
work = tempfile.TemporaryDirectory()  # the parent's: its exit handler removes it
log = open(sys.argv[1], "w")
log.write("parent line")  # buffered in the parent at the fork
def rank():
    sp.exit_process(0)
if __name__ == "__main__":
    child = mp.get_context("fork").Process(target=rank)
    child.start()
    child.join()
    print(child.exitcode, os.path.isdir(work.name))
    log.close()
"""

TWO_THREADS = """
import atexit, sys, threading, time
sys.path.insert(0, {repo!r})
import siftpipe as sp
started = threading.Event()
def handler():
    print("handler ran", flush=True)
    started.set()
    time.sleep(0.5)  # (the main thread's call comes meanwhile)
atexit.register(handler)
threading.Thread(target=sp.exit_process, args=(1,), daemon=True).start()  # a watchdog gives up
started.wait()
sp.exit_process(0)
"""


def test_exit_process_in_a_forked_child_a_second_thread_and_an_unwritable_stdout(tmp_path):
    """Its second review: a rank started by fork ran its parent's exit handlers (the parent's
    temporary directory removed while it ran) and wrote the parent's buffered file again; a
    second call from the main thread while a watchdog's call ran went into the teardown, ran
    the handlers twice, and the process exited 0, not the first call's 1; stdout on a full disk
    lost the result line and exited 0 (Python's exit: 120 and a note)."""
    import subprocess

    log = tmp_path / "parent.log"
    forked = _script(FORKED, str(log))
    assert forked.stdout.split() == ["0", "True"], forked.stderr
    assert log.read_text() == "parent line"  # once

    two = _script(TWO_THREADS)
    assert two.returncode == 1 and two.stdout.count("handler ran") == 1, (two.stdout, two.stderr)

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        lost = _script("import sys; sys.path.insert(0, {repo!r}); import siftpipe as sp; print('result'); "
                       "sp.exit_process(0)", stdout=full, stderr=subprocess.PIPE)  # fmt: skip
    assert lost.returncode == 120 and "could not flush" in lost.stderr, lost.stderr


BARE_FORK_OR_CTRL_C = """
import atexit, os, signal, sys, threading, time
sys.path.insert(0, {repo!r})
import siftpipe as sp
from tests.common import loss_field, make_samples, wait_until_waiting_inside

def sift():
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=50, audit=sys.argv[1])  # left open
    for _ in s(make_samples(400, seed=3)):
        pass
    return s

if sys.argv[2] == "fork":
    pid = os.fork()
    if pid:
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        sys.exit(0)
    kept = sift()
    sp.exit_process(0)
kept = sift()
atexit.register(print, "atexit ran", flush=True)
def interrupt():  # Ctrl-C while exit_process waits for this thread
    wait_until_waiting_inside(threading.main_thread(), "exit_process")
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
threading.Thread(target=interrupt).start()
sp.exit_process(0)
"""


@pytest.mark.parametrize("mode", ["fork", "ctrl-c"])
def test_exit_process_in_a_bare_fork_or_interrupted_while_it_waits_closes_the_log(tmp_path, mode):
    """Its third review: a child of a bare ``os.fork`` (not multiprocessing) ran neither the exit
    handlers nor multiprocessing's, and its audit log read INCOMPLETE with 0 of 400 records (a
    plain exit there runs the handlers); a Ctrl-C while it waited for a thread skipped every
    exit handler, the same loss. Both close the log whole now."""
    log = str(tmp_path / "audit")
    done = _script(BARE_FORK_OR_CTRL_C, log, mode)
    assert done.returncode == 0, done.stderr
    if mode == "fork":
        assert done.stdout.split() == ["0"], done.stderr  # the child's status
    else:
        assert "atexit ran" in done.stdout and "KeyboardInterrupt" in done.stderr, done.stderr
    report = sp.verify_log(log)
    assert report.ok and [s.records for s in report.streams] == [400], report.lines()


INTERRUPTED = """
import multiprocessing as mp, os, signal, sys, threading, time
sys.path.insert(0, {repo!r})
import siftpipe as sp
from tests.common import thread_stack, wait_until_waiting_inside

def interrupt_inside(name, thread):
    wait_until_waiting_inside(thread, name)
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)

def watchdog():
    threading.Thread(target=interrupt_inside, args=("exit_process", threading.main_thread()),
                     daemon=True).start()
    sp.exit_process(1)

def until_its_parent_ends():
    mp.parent_process().join()

def rank():
    mp.get_context("fork").Process(target=until_its_parent_ends).start()  # joined at the exit
    print("RESULT", flush=False)  # (a pipe: block-buffered)
    threading.Thread(target=interrupt_inside, args=("_exit_function", threading.main_thread()),
                     daemon=True).start()
    sp.exit_process(0)

def child_ends():
    sp.exit_process(0)

def fork_meanwhile():  # a rank started by fork once the parent's exit_process is under way
    while "exit_process" not in thread_stack(threading.main_thread()):
        time.sleep(0.01)
    child = mp.get_context("fork").Process(target=child_ends)
    child.start()
    child.join()
    print("child", child.exitcode, flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "forked-meanwhile":
        threading.Thread(target=fork_meanwhile).start()  # not a daemon: the exit waits for it
        sp.exit_process(0)
    if sys.argv[1] == "parked":
        threading.Thread(target=time.sleep, args=(3600,)).start()  # a stuck upload: not a daemon
        first = threading.Thread(target=watchdog, daemon=True)
        first.start()
        while "_end" not in thread_stack(first):
            time.sleep(0.01)  # (the watchdog's call goes first)
        sp.exit_process(0)
    child = mp.get_context("fork").Process(target=rank)
    child.start()
    child.join()
    print("rank", child.exitcode)
"""


@pytest.mark.parametrize("case", ["parked", "fork", "forked-meanwhile"])
def test_exit_process_interrupted_ends_and_says_so(case):
    """Its fourth review: a main thread parked in a second call swallowed Ctrl-C and SIGTERM while
    the first call (a watchdog's) waited for a stuck thread: only SIGKILL ended it. A rank started
    by fork, interrupted while multiprocessing's exit joined its child, lost its buffered result
    line and exited 0 without a word. Now the interrupt ends the wait (status: the first call's),
    and the fork's rank says the interrupt, keeps its line and exits 1 (as ``return`` there).
    The fifth: the parked thread's interrupt was not said; a child forked while its parent's
    call ran took itself for a second caller and never ended (its parent's state, inherited)."""
    done = _script(INTERRUPTED, case)
    if case == "parked":
        assert done.returncode == 1 and "KeyboardInterrupt" in done.stderr, done.stderr  # the watchdog's
    elif case == "forked-meanwhile":
        assert done.returncode == 0 and done.stdout.split() == ["child", "0"], (done.stdout, done.stderr)
    else:
        assert done.stdout.split() == ["RESULT", "rank", "1"], (done.stdout, done.stderr)
        assert "KeyboardInterrupt" in done.stderr


def test_exit_process_flushes_what_c_code_printed():
    """Its sixth review: an extension's ``printf`` to a pipe (torchrun's output sent to a file)
    stayed in C's stdio buffer, which ``os._exit`` does not flush: the line was lost."""
    script = (
        "import ctypes, sys; sys.path.insert(0, {repo!r}); import siftpipe as sp; "
        "ctypes.CDLL(None).printf(b'from C\\n'); sp.exit_process(0)"
    )
    done = _script(script)
    assert done.returncode == 0 and done.stdout == "from C\n", (done.stdout, done.stderr)
