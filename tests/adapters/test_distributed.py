"""Sifting on every rank: real processes, gloo backend, each test bounded in time."""

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import siftpipe as sp
from tests.common import loss_field, make_samples, roundtrip


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, world, *args, timeout=90):
    """Run ``fn(rank, world, port, *args)`` in ``world`` real processes; fail on a hang or error."""
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args)) for r in range(world)]
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
