"""Replaying a logged run without the model, and what-if re-sifting of logged losses."""

import json
import subprocess
import sys
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

import siftpipe as sp
from tests.common import loss_field, make_samples, roundtrip
from tests.contract import output_keys

SAMPLES = make_samples(800, seed=8)


def logged_run(root, policy=None, epochs=1, samples=SAMPLES, **kwargs):
    log = sp.AuditLog(root, run_id="run1", flush_every=100, **kwargs.pop("log", {}))
    s = sp.Sifter(
        None,
        loss_field,
        policy or sp.RelativeProbabilistic(2.0, 100),
        micro_batch=32,
        audit=log,
        delay=64,
        seed=11,
        **kwargs,
    )
    outs = [output_keys(s(samples)) for _ in range(epochs)]
    s.close()
    return s, outs


def test_replay_yields_exactly_what_the_run_kept_over_epochs(tmp_path):
    _, outs = logged_run(str(tmp_path), epochs=2)
    assert outs[0] != outs[1]  # the model-free scorer is the same, the random draws are not
    r = sp.replay(str(tmp_path))
    assert output_keys(r(SAMPLES)) == outs[0]
    assert output_keys(r(SAMPLES)) == outs[1]
    assert r.stats["missing"] == 0 and r.stats["kept"] == len(outs[0]) + len(outs[1])


def test_samples_without_a_url_among_shard_samples_replay_exactly(tmp_path):
    # a stream mixing shard samples with samples that carry no __url__ (in-memory extras chained
    # in): before, a part holding both was indexed under its shards only, so replay found no
    # decision for the url-less samples (AuditError), or kept/dropped them all with on_missing
    samples = make_samples(400, seed=3)
    for i, sample in enumerate(samples):
        if i % 2:
            del sample["__url__"]

    def collate(batch):  # the default collate needs every field in every sample
        plain = [{k: v for k, v in x.items() if k != "__url__"} for x in batch]
        return torch.utils.data.default_collate(plain)

    _, (out,) = logged_run(str(tmp_path), samples=samples, collate_fn=collate)
    table = sp.read_log(str(tmp_path))
    assert table.column("url").null_count == 200 and 0 < len(out) < 400
    for how in ("raise", "keep", "drop"):
        r = sp.replay(str(tmp_path), on_missing=how)
        assert output_keys(r(samples)) == out, how
        assert r.stats["missing"] == 0


@pytest.mark.parametrize("batched", [False, True], ids=["per_sample", "batched"])
def test_samples_keyed_by_one_element_tensors_are_logged_as_their_rows_and_replayed(tmp_path, batched):
    # found by review: replay told a batch from a sample by the key's ndim, so a per-sample run's
    # tensor([i]) keys read as a column of one (weights came back as tensors) and a batched run's
    # (B, 1) column as one sample's key (AuditError); it now reads items as the logged run did
    samples = [{"__key__": torch.tensor([i]), "x": torch.zeros(2), "loss": float(i % 7)} for i in range(96)]
    stream = [default_collate(samples[i : i + 32]) for i in range(0, 96, 32)] if batched else samples
    root = str(tmp_path)
    s = sp.Sifter(
        None, loss_field, sp.PruneEasy(0.5, history=64), micro_batch=None if batched else 32,
        batched=batched, audit=sp.AuditLog(root, run_id="r", flush_every=40), seed=3,
    )  # fmt: skip
    run = list(s(stream))
    s.close()
    assert sp.read_log(root).column("key").to_pylist()[:2] == ["[0]", "[1]"]  # as before for (B, 1)
    replayed = list(sp.replay(root)(stream))
    if batched:
        assert [b["__key__"].tolist() for b in replayed] == [b["__key__"].tolist() for b in run]
        assert all(torch.equal(a["__sift_weight__"], b["__sift_weight__"]) for a, b in zip(replayed, run))
    else:
        assert [x["__key__"].tolist() for x in replayed] == [x["__key__"].tolist() for x in run]
        assert [x["__sift_weight__"] for x in replayed] == [x["__sift_weight__"] for x in run]
        assert all(type(x["__sift_weight__"]) is float for x in replayed)


def test_replay_matches_repeated_keys_by_occurrence(tmp_path):
    repeated = SAMPLES[:200] + SAMPLES[:200]  # resampled shards give a key twice in an epoch
    _, (out,) = logged_run(str(tmp_path), samples=repeated)
    assert output_keys(sp.replay(str(tmp_path))(repeated)) == out


def keyed_weights(samples):
    """(key, weight) of each dict sample, in order."""
    return [(o["__key__"], o["__sift_weight__"]) for o in samples]


@pytest.mark.parametrize("mapping", ["dict", "UserDict"])
def test_replay_attaches_logged_weights(tmp_path, mapping):
    """A UserDict sample was made a (sample, weight) tuple before the audit log read its key:
    the run failed with MissingKeyError (found by review, 2026-12-05). It gets the field, as a
    dict does, and its replay hands on the same."""
    from collections import UserDict

    samples = SAMPLES if mapping == "dict" else [UserDict(s) for s in SAMPLES]
    log = sp.AuditLog(str(tmp_path), run_id="w", flush_every=100)
    s = sp.Sifter(None, loss_field, sp.PruneEasy(0.5, history=100), micro_batch=32, audit=log)
    out = list(s(samples))
    s.close()
    replayed = list(sp.replay(str(tmp_path))(samples))
    assert keyed_weights(replayed) == keyed_weights(out)


def test_weights_not_attached_are_logged_as_the_one_trained_with(tmp_path):
    """With attach_weight=False every kept sample trains at weight 1, but the log's weight column
    held the policy's weights (2.0 for PruneEasy(0.5)'s survivors) that nothing handed on (found by
    review, 2026-12-06)."""
    for attach in (False, True):
        root = tmp_path / str(attach)
        log = sp.AuditLog(str(root), run_id="w", flush_every=100)
        s = sp.Sifter(
            None, loss_field, sp.PruneEasy(0.5, history=100), micro_batch=32, audit=log, attach_weight=attach
        )
        out = list(s(SAMPLES))
        s.close()
        table = sp.read_log(str(root))
        logged = dict(zip(table.column("key").to_pylist(), table.column("weight").to_pylist(), strict=True))
        trained = {o["__key__"]: float(o.get("__sift_weight__", 1.0)) for o in out}
        assert {k: logged[k] for k in trained} == trained
        assert (max(trained.values()) == 2.0) is attach  # survivors of the pruning carry 1/(1-r)
        replayed = list(sp.replay(str(root))(SAMPLES))
        assert [(o["__key__"], float(o.get("__sift_weight__", 1.0))) for o in replayed] == list(
            trained.items()
        )


def test_replay_attaches_logged_weights_to_tuples_and_namedtuples_as_the_run_did(tmp_path):
    """The run appends the weight to a tuple sample, or fills a namedtuple's field; replay
    attached weights to dicts only, so a tuple came back without it (x, y, w = sample broke) and
    a namedtuple's field kept its default (found by review, 2026-12-05)."""
    from collections import namedtuple

    Weighted = namedtuple("Weighted", "key x weight", defaults=[1.0])
    for name, samples, field in (
        ("tuples", [(s["__key__"], s["loss"]) for s in SAMPLES], "__sift_weight__"),
        ("lists", [[s["__key__"], s["loss"]] for s in SAMPLES], "__sift_weight__"),  # a tuple, both
        ("namedtuples", [Weighted(s["__key__"], s["loss"]) for s in SAMPLES], "weight"),
    ):
        log = sp.AuditLog(str(tmp_path / name), run_id="w", flush_every=100)
        s = sp.Sifter(
            None, lambda m, b: b[1].double(), sp.PruneEasy(0.5, history=100), micro_batch=32, audit=log,
            key=0, weight_field=field,
        )  # fmt: skip
        out = list(s(samples))
        s.close()
        replayed = list(sp.replay(str(tmp_path / name), key=0, weight_field=field)(samples))
        assert [type(o) for o in replayed] == [type(o) for o in out]
        assert all(type(o) is (Weighted if name == "namedtuples" else tuple) for o in out)
        assert [(o[0], o[-1]) for o in replayed] == [(o[0], o[-1]) for o in out]
        assert {o[-1] for o in out} == {1.0, 2.0}


@pytest.mark.parametrize("mode", ["int keys", "batched", "batched output_batch"])
def test_replay_reproduces_runs_keyed_by_index_and_runs_fed_batches(tmp_path, mode):
    """A map-style dataset's integer keys (logged as their digits) and a stream of collated
    batches (the recipe's batched=True) replay to exactly the rows and weights the run trained
    on. Before (found by review): every integer-keyed sample was "missing" and a batch raised
    TypeError: unhashable type."""
    from torch.utils.data import default_collate

    samples = [{**x, "__key__": i} for i, x in enumerate(SAMPLES)] if mode == "int keys" else SAMPLES
    batched = mode != "int keys"
    stream = [default_collate(samples[i : i + 64]) for i in range(0, 800, 64)] if batched else samples
    extra = {"output_batch": 24} if mode == "batched output_batch" else {}
    log = sp.AuditLog(str(tmp_path), run_id="w", flush_every=100)
    s = sp.Sifter(None, loss_field, sp.PruneEasy(0.5, history=100), micro_batch=None if batched else 32,
                  batched=batched, audit=log, **extra)  # fmt: skip
    trained = []
    for out in s(stream):
        keys = out["__key__"].tolist() if isinstance(out["__key__"], torch.Tensor) else out["__key__"]
        keys = keys if isinstance(keys, list) else [keys]
        weights = out["__sift_weight__"]
        weights = weights.tolist() if isinstance(weights, torch.Tensor) else [weights]
        trained += list(zip(keys, weights))
    s.close()
    replayed = []
    for out in sp.replay(str(tmp_path))(stream):
        keys = out["__key__"].tolist() if isinstance(out["__key__"], torch.Tensor) else out["__key__"]
        keys = keys if isinstance(keys, list) else [keys]
        weights = out["__sift_weight__"]
        if batched:
            assert weights.dtype == torch.float32  # as the run attached them
        weights = weights.tolist() if isinstance(weights, torch.Tensor) else [weights]
        replayed += list(zip(keys, weights))
    assert 0 < len(trained) < 800 and replayed == trained


def test_replay_on_missing_samples(tmp_path):
    logged_run(str(tmp_path), samples=SAMPLES[:300])
    stranger = make_samples(310, seed=8)[300:]
    for x in stranger:
        x["__key__"] = "new-" + x["__key__"]
    with pytest.raises(sp.AuditError, match=r"'new-s000300'.*no decision in run 'run1'.*on_missing"):
        list(sp.replay(str(tmp_path))(SAMPLES[:300] + stranger))
    r = sp.replay(str(tmp_path), on_missing="keep")
    out = list(r(SAMPLES[:300] + stranger))
    assert r.stats["missing"] == 10 and out[-10:] == stranger
    # with weights attached, a logged sample gets its weight and an unlogged one none
    r = sp.replay(str(tmp_path), on_missing="keep", attach_weight=True)
    out = list(r(SAMPLES[:300] + stranger))
    assert out[-10:] == stranger and all("__sift_weight__" in o for o in out[:-10])
    r = sp.replay(str(tmp_path), on_missing="drop")
    assert all(not o["__key__"].startswith("new-") for o in r(SAMPLES[:300] + stranger))
    with pytest.raises(sp.MissingKeyError, match="no field '__key__'"):
        list(sp.replay(str(tmp_path))([{"x": 1}]))


def test_a_shard_read_again_after_the_cache_dropped_it_is_matched_from_where_it_was(tmp_path):
    # found by review: a resampled shard read again after its decisions were evicted from the
    # cache was matched from its first occurrence again: the first visit's decisions handed on
    # for the second, with clean stats
    rng = np.random.default_rng(3)
    again = [{**x, "loss": float(rng.exponential())} for x in SAMPLES[:100]]  # shard 0, new losses
    stream = SAMPLES[:400] + again  # shards 0-3, then shard 0 again in the same epoch
    _, (out,) = logged_run(str(tmp_path), samples=stream)
    for cache in (1, 2, 64):
        r = sp.replay(str(tmp_path), cache_shards=cache)
        assert output_keys(r(stream)) == out and r.stats["missing"] == 0, cache


def test_replay_holds_a_bounded_number_of_shards(tmp_path):
    logged_run(str(tmp_path))
    r = sp.replay(str(tmp_path), cache_shards=2)
    list(r(SAMPLES))
    assert len(r._shards) == 2 and r.held_bytes < 2 * 100 * 300


def test_what_replay_holds_is_bounded_by_its_shards_not_the_epochs_samples(tmp_path):
    # found 2026-12-05 (fourth session): every (key, epoch) handed on was counted in a dict of
    # its own, about 200 bytes a sample, growing with the epoch however few shards were held
    import tracemalloc

    samples = make_samples(6000, seed=3)  # 60 shards of 100
    logged_run(str(tmp_path), policy=sp.Uniform(1.0), samples=samples)
    r = sp.replay(str(tmp_path), cache_shards=2)
    tracemalloc.start()
    try:
        it = r(samples)
        for _ in range(300):
            next(it)
        early = tracemalloc.get_traced_memory()[0]
        rest = sum(1 for _ in it)
        late = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert rest == 5700
    # 2 shards held throughout; what grows is the evicted shards' used flags, a byte a sample
    assert late - early < 20 * rest, (early, late)


def test_replay_refuses_an_ambiguous_log(tmp_path):
    for run in ("a", "b"):
        log = sp.AuditLog(str(tmp_path), run_id=run)
        s = sp.Sifter(None, loss_field, sp.Uniform(0.5), audit=log)
        list(s(SAMPLES[:50]))
        s.close()
    with pytest.raises(sp.ConfigError, match=r"holds runs \['a', 'b'\]"):
        sp.replay(str(tmp_path))
    assert len(output_keys(sp.replay(str(tmp_path), run="b")(SAMPLES[:50]))) > 0
    with pytest.raises(sp.AuditError, match="no audit parts"):
        sp.replay(str(tmp_path / "empty"))


def test_replay_through_a_resumed_run(tmp_path):
    log = sp.AuditLog(str(tmp_path), run_id="r", flush_every=64)
    first = sp.Sifter(None, loss_field, sp.TopFraction(0.4), micro_batch=32, audit=log)
    it = first(SAMPLES)
    head = [next(it)["__key__"] for _ in range(100)]
    state = first.state_dict()
    for _ in range(50):
        next(it)
    log.close()
    second = sp.Sifter(
        None, loss_field, sp.TopFraction(0.4), micro_batch=32, audit=sp.AuditLog(str(tmp_path))
    )
    second.load_state_dict(state)
    tail = output_keys(second(SAMPLES[state["consumed"] :]))
    second.close()
    assert output_keys(sp.replay(str(tmp_path))(SAMPLES)) == head + tail


def test_whatif_with_the_logged_policy_reproduces_the_log(tmp_path):
    logged_run(str(tmp_path), epochs=2, on_nan="drop")
    results = sp.whatif(str(tmp_path), [sp.RelativeProbabilistic(2.0, 100)])
    assert results[0].flips == 0 and results[0].samples == 1600
    # the reproduction is not trivial: another seed flips many decisions
    assert sp.whatif(str(tmp_path), [sp.RelativeProbabilistic(2.0, 100)], seed=12)[0].flips > 100


def test_whatif_counts_flips_after_a_gap_in_the_log_apart_and_says_why(tmp_path, capsys):
    """A log missing parts in its middle (lost, or dropped under on_full='drop'): the logged
    policy re-run read as hundreds of flips after the gap, every logged decision right, and the
    only warning said that records were missing (found by review, 2026-12-06)."""
    from siftpipe.cli import main as cli

    logged_run(str(tmp_path), epochs=2)
    (stream,) = {p.parent for p in tmp_path.rglob("part-*.parquet")}
    gone = sorted(stream.glob("part-*.parquet"))[3]
    seqs = pq.read_table(gone).column("seq").to_pylist()
    lo, hi = min(seqs), max(seqs)
    gone.unlink()
    (stream / f"_manifest-{gone.stem.removeprefix('part-')}.json").unlink()
    policy = sp.RelativeProbabilistic(2.0, 100)
    with pytest.warns(UserWarning, match=rf"run=run1 rank=0 lacks seq {lo}\.\.{hi}.*flips_after_gap"):
        (result,) = sp.whatif(str(tmp_path), [policy])
    after = 1600 - hi - 1
    assert result.samples == 1600 - len(seqs) and result.after_gap == after
    assert result.flips > 0 and result.flips_after_gap == result.flips  # none before the gap
    with pytest.warns(UserWarning, match=rf"lacks seq {lo}\.\.{hi}"):
        assert cli(["log", "whatif", str(tmp_path), "--beta", "2", "--json"]) == 0
    out = capsys.readouterr()
    (row,) = json.loads(out.out)["results"]
    assert row["flips_after_gap"] == row["flips"] == result.flips and row["after_gap"] == after
    shown = subprocess.run(
        [sys.executable, "-m", "siftpipe", "log", "whatif", str(tmp_path), "--beta", "2"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert f"siftpipe: warning: run=run1 rank=0 lacks seq {lo}..{hi}" in shown.stderr  # (one prefix)
    assert "after a gap" in shown.stdout and f"{after} of {1600 - len(seqs)} decisions" in shown.stdout
    # a whole log: nothing after a gap, nothing said
    whole = tmp_path / "whole"
    logged_run(str(whole), epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (result,) = sp.whatif(str(whole), [policy])
    assert result.flips == 0 and result.after_gap == 0


def test_whatif_reports_keep_rates_and_flips(tmp_path):
    rng = np.random.default_rng(0)
    samples = make_samples(4000, seed=1)
    for x in samples:
        x["loss"] = float(rng.lognormal())
    logged_run(str(tmp_path), samples=samples, policy=sp.RelativeProbabilistic(1.0, 500))
    results = sp.whatif(
        str(tmp_path), [sp.RelativeProbabilistic(b, 500) for b in (0.5, 1.0, 3.0)] + [sp.Uniform(1.0)]
    )
    rates = [r.keep_rate for r in results]
    # warm-up keeps the first 64 of 4000; the rest keep about 1/(1+beta)
    for rate, beta in zip(rates, (0.5, 1.0, 3.0)):
        assert rate == pytest.approx(64 / 4000 + (1 - 64 / 4000) / (1 + beta), abs=0.03)
    assert results[1].flips == 0
    assert results[0].to_kept > 0 and results[0].to_dropped < results[0].to_kept
    assert results[3].keep_rate == 1.0 and results[3].to_dropped == 0
    table = sp.read_log(str(tmp_path))
    rechunked = sp.whatif(table, [sp.TopFraction(0.5)], micro_batch=100, delay=0)[0]
    assert rechunked.kept == 2000


def test_whatif_on_a_real_model_log(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    log = sp.AuditLog(str(tmp_path), run_id="m")
    s = sp.Sifter(
        model, sp.CrossEntropy("x", "y"), sp.RelativeProbabilistic(1.0, 200), micro_batch=50, audit=log
    )
    list(s(SAMPLES))
    s.close()
    assert sp.whatif(str(tmp_path), [sp.RelativeProbabilistic(1.0, 200)])[0].flips == 0


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_keys_and_urls_that_are_not_valid_utf8_are_logged_escaped_and_replayed(tmp_path, writer):
    # found by review: tarfile decodes a member name that is not UTF-8 to a str with lone
    # surrogates; the audit log failed on it (a bare UnicodeEncodeError in training, or the
    # attempt's records lost at close) while the stage without a log ran fine
    samples = [
        {**x, "__key__": f"caf\udce9-{i:03d}", "__url__": f"shard-\udcff{i // 50}.tar"}
        for i, x in enumerate(SAMPLES[:100])
    ]
    _, (out,) = logged_run(str(tmp_path), samples=samples, log={"writer": writer})
    report = sp.verify_log(str(tmp_path))
    assert report.ok and report.streams[0].records == 100
    table = sp.read_log(str(tmp_path))
    assert sorted(table.column("key").to_pylist())[0] == "caf\\xe9-000"
    assert set(table.column("url").to_pylist()) == {"shard-\\xff0.tar", "shard-\\xff1.tar"}
    r = sp.replay(str(tmp_path))
    assert output_keys(r(samples)) == out and r.stats["missing"] == 0


def test_keys_with_any_lone_surrogate_are_logged_remembered_and_replayed(tmp_path):
    """A surrogate that no undecodable byte gives ("\ud800", from JSON) raised at the part's
    seal, and that part's records were lost while close() said nothing wrong; and a score memory
    raised a bare UnicodeEncodeError on any lone surrogate the audit log took (found by review,
    2026-12-06)."""
    samples = [
        {**x, "__key__": f"\ud800{i:03d}" if i % 2 else f"caf\udce9-{i:03d}"}
        for i, x in enumerate(SAMPLES[:100])
    ]
    memory = sp.ScoreMemory(1000)
    s, outs = logged_run(str(tmp_path), samples=samples, epochs=2, memory=memory)
    assert len(memory) == 100 and s.stats.from_memory == 100  # the second epoch from the memory
    report = sp.verify_log(str(tmp_path))
    assert report.ok and report.streams[0].records == 200
    keys = set(sp.read_log(str(tmp_path)).column("key").to_pylist())
    assert "\\ud800001" in keys and "caf\\xe9-000" in keys and len(keys) == 100
    r = sp.replay(str(tmp_path))
    assert [output_keys(r(samples)) for _ in outs] == outs and r.stats["missing"] == 0


def test_tensor_keys_mixed_with_text_keys_are_logged_as_their_values(tmp_path):
    """Two datasets mixed, one keyed by text, one by 0-d tensors: only a micro-batch whose first
    key was a tensor had its keys read as values, so the log held "tensor(1)" where the memory
    used 1, and replay found no decision for those samples (found by review, 2026-12-06)."""
    samples = [
        {**x, "__key__": f"a{i}" if i % 2 == 0 else torch.tensor(i)} for i, x in enumerate(SAMPLES[:96])
    ]
    _, (out,) = logged_run(str(tmp_path), samples=samples)
    keys = sp.read_log(str(tmp_path)).column("key").to_pylist()
    assert sorted(keys) == sorted(f"a{i}" if i % 2 == 0 else str(i) for i in range(96))
    r = sp.replay(str(tmp_path))
    assert output_keys(r(samples)) == out and r.stats["missing"] == 0


@pytest.mark.parametrize("batched", [False, True])
def test_rows_a_pass_was_left_before_are_counted_and_read_as_not_kept(tmp_path, batched):
    # found by review: a pass left early (EqualSteps ending an epoch on a rank with more data, a
    # break) recorded the rest of its input batch as kept; stats, read_log and replay counted
    # those never-trained samples as kept, and verify said nothing
    root = str(tmp_path / "log")
    data = SAMPLES[:300] if not batched else collated(SAMPLES[:300], 50)
    s = sp.Sifter(
        None, loss_field, sp.Uniform(0.7), micro_batch=None if batched else 100, output_batch=10,
        batched=batched, audit=sp.AuditLog(root, run_id="r"), seed=1,
    )  # fmt: skip
    it = s(data)
    trained = output_keys([next(it) for _ in range(3)])  # three steps, then the epoch is over
    it.close()
    second = output_keys(s(data))
    s.close()
    assert s.stats.unhanded > 0 and s.stats.kept == len(trained) + len(second) + s.stats.unhanded
    table = sp.read_log(root)
    assert sum(table.column("kept").to_pylist()) == len(trained) + len(second)
    decided = sp.read_log(root, as_decided=True)
    assert sum(decided.column("kept").to_pylist()) == s.stats.kept
    r = sp.replay(root)
    first = data[: 1 if batched else 100]  # what the live pass read before it was left
    assert output_keys(r(first)) == trained and output_keys(r(data)) == second
    assert sp.whatif(root, [sp.Uniform(0.7)])[0].flips == 0  # the decisions themselves
    report = sp.verify_log(root)
    assert report.ok and f"{s.stats.unhanded} records decided kept were never handed on" in "\n".join(
        report.lines()
    )
    # the command line too (found by review: `siftpipe log keys` read the raw column and listed
    # the never-trained rows as kept, and --dropped left them out)
    import contextlib
    import io

    from siftpipe.cli import main

    handed = len(trained) + len(second)
    for flag, expected in (([], handed), (["--dropped"], len(table) - handed)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["log", "keys", root, *flag]) == 0
        assert len(out.getvalue().split()) == expected, flag


_KILLED_AFTER_LEAVING_A_PASS = """
import json, os, signal, sys
import siftpipe as sp
from tests.common import loss_field, make_samples
data = make_samples(300, seed=8)
log = json.loads(sys.argv[2])  # AuditLog settings
s = sp.Sifter(None, loss_field, sp.Uniform(0.7), micro_batch=100, output_batch=10,
              audit=sp.AuditLog(sys.argv[1], run_id="r", **log), seed=1)
it = s(data)
first = [next(it) for _ in range(3)]  # three steps, then the epoch is over
it.close()
it = s(data)
second = [next(it) for _ in range(5)]
s.audit.flush()  # every part so far is written: what the last checkpoint does
print(json.dumps({"unhanded": s.stats.unhanded}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(): no end marker
"""


@pytest.mark.adversarial
@pytest.mark.parametrize("log", [{}, {"on_full": "drop", "max_queue_bytes": 1, "flush_every": 100}])
def test_rows_a_pass_was_left_before_read_as_not_kept_after_the_attempt_is_killed(tmp_path, log):
    # found by review: which rows a pass left before handing on were written only in the end
    # marker, at close(); an attempt killed later had none, and its log read them as kept. A
    # writer that drops parts when its queue is full dropped the note too (it takes no room)
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = str(tmp_path / "log")
    code = _KILLED_AFTER_LEAVING_A_PASS
    child = subprocess.run(
        [sys.executable, "-c", code, root, json.dumps(log)], check=False, capture_output=True, text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    unhanded = json.loads(child.stdout)["unhanded"]
    assert unhanded > 0
    kept = sum(sp.read_log(root).column("kept").to_pylist())
    decided = sum(sp.read_log(root, as_decided=True).column("kept").to_pylist())
    assert decided - kept == unhanded
    lines = "\n".join(sp.verify_log(root).lines())
    assert "did not close" in lines and f"{unhanded} records decided kept were never handed on" in lines


@pytest.mark.adversarial
def test_a_deleted_unhanded_note_of_a_killed_attempt_is_reported_not_read_as_trained(tmp_path):
    # found by review, 2026-12-05: the note was the only object that said which rows of a killed
    # attempt were never handed on; deleted, read_log read them as kept and verify said OK
    import subprocess
    import sys
    from pathlib import Path

    root = str(tmp_path / "log")
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_LEAVING_A_PASS, root, "{}"], check=False, capture_output=True,
        text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    notes = list((tmp_path / "log").rglob("_unhanded-*.json"))
    assert len(notes) == 1 and sp.verify_log(root).ok
    notes[0].unlink()
    report = sp.verify_log(root)
    assert not report.ok
    lines = "\n".join(report.lines())
    assert "a note is missing" in lines and "hold 1 range(s)" in lines, lines


def collated(samples, size):
    from torch.utils.data import default_collate

    return [default_collate(samples[i : i + size]) for i in range(0, len(samples), size)]


_BATCHES = collated(make_samples(300, seed=8), 50)


def _uniform_log(root, drop_last=True):
    """Batched Uniform(0.7) in batches of 32 kept rows, logged to ``root`` (run "r")."""
    return sp.Sifter(
        None, loss_field, sp.Uniform(0.7), micro_batch=None, output_batch=32, batched=True,
        drop_last=drop_last, seed=1, audit=sp.AuditLog(root, run_id="r"),
    )  # fmt: skip


@pytest.mark.parametrize("batched", [False, True])
def test_drop_last_hands_on_only_full_batches_and_the_log_reads_the_rest_as_not_kept(tmp_path, batched):
    # the short batch a sifted pass ends with changes size every epoch (a cudnn.benchmark
    # autotune, a torch.compile recompile each): drop_last hands on full batches only, and the
    # dropped rows, recorded kept when decided, must read as not kept everywhere
    root = str(tmp_path / "log")
    data = SAMPLES[:300] if not batched else collated(SAMPLES[:300], 50)
    s = sp.Sifter(
        None, loss_field, sp.Uniform(0.7), micro_batch=None if batched else 100, output_batch=32,
        batched=batched, drop_last=True, audit=sp.AuditLog(root, run_id="r"), seed=1,
    )  # fmt: skip
    passes = []
    for epoch in range(3):
        s.set_epoch(epoch)
        passes.append(list(s(data)))
    s.close()
    sizes = {len(b["__key__"]) for batches in passes for b in batches}
    assert sizes == {32}
    handed = sum(len(b["__key__"]) for batches in passes for b in batches)
    assert 0 < s.stats.unhanded < 3 * 32 and s.stats.kept == handed + s.stats.unhanded
    assert sum(sp.read_log(root).column("kept").to_pylist()) == handed
    r = sp.replay(root)
    assert [output_keys(r(data)) for _ in range(3)] == [output_keys(b) for b in passes]
    report = sp.verify_log(root)
    assert report.ok and f"{s.stats.unhanded} records decided kept were never handed on" in "\n".join(
        report.lines()
    )
    # the manifests say how the stage handed on, which is why the short batches read as not kept
    from siftpipe.audit.reader import list_parts

    stages = [i.manifest["stage"] for i in list_parts(root)[1] if i.manifest]
    assert stages and all(st["output_batch"] == 32 and st["drop_last"] is True for st in stages)


@pytest.mark.parametrize("resume", [False, True])
def test_a_batch_taken_back_reads_as_not_kept_also_after_a_resume(tmp_path, resume):
    """Sifter.discard_last (EqualSteps' discarded batch) ends the pass: a checkpoint taken after it
    resumes into the next pass, as the uninterrupted run goes on, and no attempt's log reads the
    batch as kept (found by review: the pass stayed open, and a resumed attempt re-read its rows
    as handed on while the first attempt's note was superseded)."""
    root = str(tmp_path / "log")
    data = SAMPLES[:200]

    def stage():
        return sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=40, output_batch=6,
                         audit=sp.AuditLog(root, run_id="job", flush_every=10), seed=3)  # fmt: skip

    s = stage()
    it = s(data)
    trained = list(next(it)["__key__"])
    taken_back = list(next(it)["__key__"])
    assert s.discard_last() == 6 and s.discard_last() == 0  # taken back once
    with pytest.raises(sp.PassClosedError, match="discard_last"):
        next(it)
    state = roundtrip(s.state_dict())
    assert not state["pass_open"]
    if resume:
        s.audit.flush()
        s = stage()
        s.load_state_dict(state)
    second = [k for b in s(data) for k in b["__key__"]]  # the next pass: the whole data again
    s.close()
    table = sp.read_log(root)
    kept = [
        k
        for k, e, keep in zip(*(table.column(c).to_pylist() for c in ("key", "epoch", "kept")))
        if keep and e == 0
    ]
    assert kept == trained and not set(kept) & set(taken_back)  # of the first pass
    assert len(second) == s.stats.kept - s.stats.unhanded - len(trained)
    assert sp.verify_log(root).ok


def _kept_keys(root):
    table = sp.read_log(root)
    return [k for k, keep in zip(*(table.column(c).to_pylist() for c in ("key", "kept"))) if keep]


@pytest.mark.parametrize("batched", [False, True])
def test_a_batch_taken_back_after_a_checkpoint_or_a_prefetcher_read_on_reads_as_not_kept(tmp_path, batched):
    """discard_last finds the batch by its seqs, not by the pending groups: after state_dict() (or
    consumed) forgot its group it notes that batch (before, SiftError: it could not find it), and
    given ``fetched`` it notes the batch the consumer read and those a prefetcher read after it
    (before, the prefetcher's batch alone, and the discarded one read as kept)."""
    root = str(tmp_path / "log")
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=None if batched else 40,
                  output_batch=None if batched else 8, batched=batched, seed=3,
                  audit=sp.AuditLog(root, run_id="r"))  # fmt: skip
    data = collated(SAMPLES[:400], 50) if batched else SAMPLES[:400]
    it = s(data)
    read = [list(next(it)["__key__"]) for _ in range(4)]  # the consumer trains the first two
    s.state_dict()  # puts the handed-on rows behind the stage
    assert s.discard_last(fetched=3) == len(read[2]) + len(read[3])  # the 4th: a prefetcher's
    assert s.discard_last() == 0  # taken back once
    with pytest.raises(sp.PassClosedError, match="discard_last"):
        next(it)
    s.close()
    assert s.stats.unhanded >= len(read[2]) + len(read[3])
    kept = _kept_keys(root)
    assert kept == read[0] + read[1]
    assert sp.verify_log(root).ok


def test_a_prefetcher_that_read_the_pass_to_its_end_still_has_its_batch_taken_back(tmp_path):
    root = str(tmp_path / "log")
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=None, batched=True, seed=3,
                  audit=sp.AuditLog(root, run_id="r"))  # fmt: skip
    got = [list(b["__key__"]) for b in s(collated(SAMPLES[:200], 50))]  # the pass read to its end
    assert len(got) == 4
    assert s.discard_last(fetched=3) == len(got[2]) + len(got[3])
    s.close()
    assert _kept_keys(root) == got[0] + got[1] and s.stats.unhanded == len(got[2]) + len(got[3])
    assert sp.verify_log(root).ok


def test_taking_back_a_batch_of_an_ended_pass_leaves_the_next_pass_alone(tmp_path):
    """Found by review: after a prefetcher read pass 1 to its end and the next pass was opened
    (not read yet), taking a batch of pass 1 back dropped the stage's hold on pass 2 without
    closing it: opening pass 3 then left pass 2 running, two passes on one ledger."""
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=None, batched=True, seed=3)
    data = collated(SAMPLES[:400], 50)
    first = list(s(data))
    second = s(data)
    assert s.discard_last(fetched=len(first) - 1) > 0
    next(second)  # still the stage's current pass
    third = s(data)  # ...so opening another closes it
    with pytest.raises(sp.PassClosedError):
        next(second)
    assert len(list(third)) > 0


def test_discard_last_that_cannot_be_the_stages_batch_is_refused_and_notes_nothing(tmp_path):
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=None, batched=True, seed=3)
    it = s(collated(SAMPLES[:200], 50))
    next(it)
    # the consumer read more batches than the stage handed on: something between them re-batches
    with pytest.raises(sp.SiftError, match="the stage handed on 1"):
        s.discard_last(fetched=2)
    with pytest.raises(sp.SiftError, match="the stage handed on 1"):
        s.discard_last(fetched=0)
    assert s.stats.unhanded == 0
    # more than RECENT_BATCHES behind the last batch handed on
    s = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=None, batched=True, seed=3)
    it = s(collated(SAMPLES, 5))
    for _ in range(70):
        next(it)
    with pytest.raises(sp.SiftError, match="remembers the last 64"):
        s.discard_last(fetched=3)
    assert s.discard_last(fetched=7) == 5 * 64 and s.stats.unhanded == 5 * 64
    # a stage handing on single samples has no batch to take back
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=40, seed=3)
    next(iter(s(SAMPLES[:100])))
    assert s.discard_last() == 0 and s.discard_last(fetched=1) == 0


_CHECKPOINT_AFTER_THE_LAST_FULL_BATCH = """
import os, sys
import torch
from torch.utils.data import default_collate
import siftpipe as sp
from tests.common import loss_field, make_samples
samples = make_samples(300, seed=8)
batches = [default_collate(samples[i : i + 50]) for i in range(0, 300, 50)]
s = sp.Sifter(None, loss_field, sp.Uniform(0.7), micro_batch=None, output_batch=32, batched=True,
              drop_last=True, seed=1, audit=sp.AuditLog(sys.argv[1], run_id="r"))
got = []
for b in s(batches):
    got.append(list(b["__key__"]))
    if len(got) == int(sys.argv[3]):  # the pass's last full batch: its short one still pending
        torch.save((s.state_dict(), got), sys.argv[2])
        s.audit.flush()
        os._exit(0)  # killed: no close(), no note of its own
"""


@pytest.mark.adversarial
def test_a_short_batch_dropped_after_a_resume_reads_as_not_kept(tmp_path):
    # found by review: a resumed attempt notes the short batch drop_last dropped, but those rows
    # were recorded by the attempt before; readers applied a note to its own attempt's records
    # only, so read_log, replay and `siftpipe log keys` read them as kept (trained)
    import subprocess
    import sys
    from pathlib import Path

    batches, make = _BATCHES, _uniform_log
    ref = make(str(tmp_path / "ref"))
    full = len(list(ref(batches)))
    ref.close()
    root, saved = str(tmp_path / "log"), str(tmp_path / "state.pt")
    subprocess.run(
        [sys.executable, "-c", _CHECKPOINT_AFTER_THE_LAST_FULL_BATCH, root, saved, str(full)],
        check=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    state, got = torch.load(saved, weights_only=False)
    s = make(root)
    s.load_state_dict(state)
    got += [list(b["__key__"]) for b in s(batches[s.resume_from :])]
    s.close()
    handed = [k for batch in got for k in batch]
    assert len(got) == full and s.stats.unhanded > 0
    table = sp.read_log(root)
    kept = [k for k, v in zip(table.column("key").to_pylist(), table.column("kept").to_pylist()) if v]
    assert kept == handed
    assert output_keys(sp.replay(root)(batches)) == handed
    report = sp.verify_log(root)
    assert report.ok


@pytest.mark.adversarial
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_job_that_failed_after_its_checkpoint_and_resumed_logs_what_was_handed_on(tmp_path, drop_last):
    # found by review: the failing attempt left its pass on the way out and noted the rows it
    # had not handed on; the resumed attempt re-read and handed them on, yet read_log, replay and
    # verify read them as never handed on (a note held over rows a later attempt re-read)
    import re

    batches = _BATCHES

    def make(root):
        return _uniform_log(root, drop_last)

    class Failed(Exception):
        pass

    def run(stage, first, source, out, cut=None):
        for epoch in range(first, 3):
            if epoch != first or source is None:
                stage.set_epoch(epoch)
            for b in stage(batches if source is None else source):
                out.append(list(b["__key__"]))
                if len(out) == cut:
                    state = stage.state_dict()
                    raise Failed(state)
            source = None

    total = []
    run(make(str(tmp_path / "ref")), 0, None, total)
    for cut in range(1, len(total) + 1):
        root, got = str(tmp_path / f"c{cut}"), []
        first = make(root)
        with pytest.raises(Failed) as failed:
            run(first, 0, None, got, cut)
        first.close()  # the way out of a failing job: its pass was left, and noted
        resumed = make(root)
        resumed.load_state_dict(failed.value.args[0])
        at = resumed.resume_from
        run(resumed, resumed.epoch, batches[at:] if at is not None else None, got)
        resumed.close()
        handed = [k for batch in got for k in batch]
        table = sp.read_log(root)
        kept = [k for k, v in zip(table.column("key").to_pylist(), table.column("kept").to_pylist()) if v]
        assert kept == handed, cut
        r = sp.replay(root)
        assert [k for _ in range(3) for k in output_keys(r(batches))] == handed, cut
        lines = "\n".join(sp.verify_log(root).lines())
        unhanded = sum(
            1 for v, d in zip(table.column("kept").to_pylist(),
                              sp.read_log(root, as_decided=True).column("kept").to_pylist()) if d and not v
        )  # fmt: skip
        said = re.findall(r"(\d+) records decided kept were never handed on", lines)
        assert sum(map(int, said)) == unhanded, cut  # per attempt, each of its own records


@pytest.mark.parametrize("batched", [False, True])
def test_keys_given_as_0d_tensors_or_by_a_callable_are_logged_and_replayed_as_their_values(tmp_path, batched):
    # per sample, "__key__": torch.tensor(i); batched, key= a callable returning the key tensor.
    # Before: the log held "tensor(0)"... for the callable (the field gave "0"), the memory "0",
    # and a batched mid-pass checkpoint raised from digest (a 0-d tensor viewed as bytes)
    losses = np.random.default_rng(0).exponential(size=64)
    if batched:
        stream = [
            {"idx": torch.arange(i, i + 8), "loss": torch.from_numpy(losses[i : i + 8])}
            for i in range(0, 64, 8)
        ]
        kw = {"batched": True, "micro_batch": None, "key": lambda b: b["idx"], "output_batch": 4}
    else:
        stream = [{"__key__": torch.tensor(i), "loss": float(losses[i])} for i in range(64)]
        kw = {"micro_batch": 16}

    def make(log):
        return sp.Sifter(None, loss_field, sp.Uniform(0.5), seed=0, audit=log, **kw)

    s = make(sp.AuditLog(str(tmp_path / "a"), run_id="w"))
    it = s(stream)
    first = [next(it)]
    state = roundtrip(s.state_dict())  # mid-pass
    rest = list(it)
    s.close()
    assert sp.read_log(str(tmp_path / "a")).column("key").to_pylist() == [str(i) for i in range(64)]
    field = "idx" if batched else "__key__"

    def keys(out):
        return [int(k) for b in out for k in (b[field].reshape(-1).tolist())]

    assert 0 < len(keys(first + rest)) < 64
    assert keys(sp.replay(str(tmp_path / "a"), key=field)(stream)) == keys(first + rest)
    resumed = make(None)
    resumed.load_state_dict(state)
    assert keys(resumed(stream[state["consumed"] :])) == keys(rest)


def test_replaying_all_ranks_of_shards_two_ranks_both_read_is_refused_not_mixed(tmp_path):
    """Two ranks that read the same shards (resampled shards, a split that is not by shard):
    each numbers its records from 0, so replay(rank=None) ordered both ranks' decisions by seq
    and handed rank 1's stream rank 0's decisions, with no error and nothing missing (found by
    review, 2026-12-05). Now that is an AuditError asking for rank=; one rank replays exactly, and
    ranks that read apart shards still replay together."""
    root = str(tmp_path / "log")
    outs = {}
    for rank in (0, 1):
        log = sp.AuditLog(root, flush_every=128, run_id="r1", rank=rank, writer="thread")
        s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32, audit=log, seed=3 + rank)
        outs[rank] = output_keys(s(SAMPLES[:400]))
        s.close()
    assert outs[0] != outs[1]
    with pytest.raises(sp.AuditError, match=r"ranks \[0, 1\] .* both decided .*rank="):
        list(sp.replay(root)(SAMPLES[:400]))
    assert output_keys(sp.replay(root, rank=1)(SAMPLES[:400])) == outs[1]

    apart = str(tmp_path / "apart")
    split = {0: [x for x in SAMPLES if x["__url__"].endswith(("0.tar", "2.tar"))]}
    split[1] = [x for x in SAMPLES if x not in split[0]]
    for rank in (0, 1):
        log = sp.AuditLog(apart, flush_every=128, run_id="r1", rank=rank, writer="thread")
        s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32, audit=log, seed=3 + rank)
        outs[rank] = output_keys(s(split[rank]))
        s.close()
    assert output_keys(sp.replay(apart)(split[1])) == outs[1]


def test_a_pass_opened_and_never_read_is_not_an_epoch_in_replay_as_in_the_run(tmp_path):
    # found 2026-12-05 (fourth session): the Sifter does not count an unread pass as an epoch,
    # replay did, and the next pass was matched with epoch 1's (missing) decisions
    samples = make_samples(200, seed=1)
    s = sp.Sifter(
        None, loss_field, sp.RelativeProbabilistic(2.0, 100), micro_batch=16, delay=32, seed=1,
        audit=sp.AuditLog(str(tmp_path), run_id="r", flush_every=50),
    )  # fmt: skip
    s(samples)  # opened, never read (a probe)
    run = output_keys(s(samples))
    assert s.epoch == 0
    s.close()
    r = sp.replay(str(tmp_path))
    r(samples)
    assert output_keys(r(samples)) == run and r.epoch == 0
    r(samples)
    assert r.epoch == 1  # after a pass that was read, a new call is the next epoch


@pytest.mark.parametrize("batched", [False, True])
def test_a_run_keyed_by_shard_key_replays_with_the_same_key(tmp_path, batched):
    """Three shards numbering their samples alike (what sp.shard_key is for): the run could not
    be replayed, replay(key=sp.shard_key) refused as 'no field <function ...>' (found by review,
    2026-12-05)."""
    from torch.utils.data import default_collate

    samples = [
        {"__key__": f"{i:06d}", "__url__": f"/data/shard-{s}.tar", "loss": float((7 * i + s) % 11)}
        for s in range(3)
        for i in range(20)
    ]
    data = [default_collate(samples[i : i + 10]) for i in range(0, 60, 10)] if batched else samples
    root = str(tmp_path / "log")
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=10, key=sp.shard_key, batched=batched,
                  audit=sp.AuditLog(root))  # fmt: skip

    def keys(items):
        return [k for x in items for k in (sp.shard_key(x) if batched else [sp.shard_key(x)])]

    kept = keys(s(data))
    s.close()
    replayed = keys(sp.replay(root, key=sp.shard_key)(data))
    assert replayed == kept and len(kept) == 30
    with pytest.raises(sp.AuditError, match="key=sp.shard_key"):
        list(sp.replay(root)(data))


@pytest.mark.parametrize("override", [None, "seed", "delay"])
def test_whatif_says_when_a_resume_changed_the_settings_it_replays_with(tmp_path, override):
    """A resume that overrode the stage's seed, policy or warm-up: the logged policy re-run
    flipped decisions made after it, with nothing said, where zero flips is the log's check
    (found by review, 2026-12-05). A plain resume replays with no flip and no warning."""
    import warnings

    root = str(tmp_path / "log")
    samples = make_samples(600, seed=1)

    def stage(seed, delay):
        log = sp.AuditLog(root, run_id="r1", flush_every=50)
        policy = sp.RelativeProbabilistic(1.0, 100)
        return sp.Sifter(None, loss_field, policy, micro_batch=32, delay=delay, seed=seed, audit=log)

    first = stage(1, 0)
    it = first(samples)
    for _ in range(200):
        next(it)
    state = roundtrip(first.state_dict())
    first.close()
    again = stage(2 if override == "seed" else 1, 64 if override == "delay" else 0)
    again.load_state_dict(state, **({"override": (override,)} if override else {}))
    list(again(samples[again.resume_from :]))
    again.close()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        result = sp.whatif(root, [sp.RelativeProbabilistic(1.0, 100)])[0]
    changed = [w for w in said if "settings changed between the attempts" in str(w.message)]
    if override is None:
        assert result.flips == 0 and not changed
    else:
        assert len(changed) == 1


def test_whatif_over_a_recipe_log_says_which_rows_have_no_loss_and_which_losses_are_remembered(tmp_path):
    """The default recipe's log: the first pass has no loss (never trained) and every later loss
    is one a training step handed back in an earlier pass. Every policy kept the rows with no
    loss, read as a keep rate, and the remembered losses were replayed as if scored fresh, with
    nothing said (found by review, 2026-12-06)."""
    from siftpipe.cli import main as cli

    samples = make_samples(200, seed=3)
    log = sp.AuditLog(str(tmp_path), run_id="recipe", flush_every=100)
    s = sp.recipe(None, loss_field, budget=3 * len(samples), audit=log, seed=0)
    rng = np.random.default_rng(0)
    for epoch in range(3):
        s.set_epoch(epoch)
        for x in s(samples):
            s.observe([x["__key__"]], np.array([rng.exponential()]))
    s.close()
    with pytest.warns(UserWarning) as said:
        (result,) = sp.whatif(str(tmp_path), [sp.TopFraction(0.5)])
    text = " ".join(str(w.message) for w in said)
    assert result.no_loss == len(samples) and result.samples == 3 * len(samples)
    assert f"{len(samples)} of {3 * len(samples)} decisions have no loss in the log" in text
    assert f"{2 * len(samples)} of {3 * len(samples)} decisions were made from losses training steps" in text
    assert result.remembered == 2 * len(samples)
    # every policy keeps the rows with no loss: TopFraction(0.5) keeps half of the others only
    assert result.kept == len(samples) + len(samples)
    with pytest.warns(UserWarning, match="no loss in the log") as said:
        assert cli(["log", "whatif", str(tmp_path), "--top", "0.5"]) == 0
    assert sum("no loss in the log" in str(w.message) for w in said) == 1  # once, with the totals
    # a log whose losses were all scored by forwards (remembered or not) has nothing to say
    fresh = tmp_path / "forward"
    log = sp.AuditLog(str(fresh), run_id="forward", flush_every=100)
    s = sp.Sifter(None, loss_field, sp.TopFraction(0.5), memory=sp.ScoreMemory(1000, max_age=2), audit=log)
    for epoch in range(2):
        s.set_epoch(epoch)
        list(s(samples))
    s.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (result,) = sp.whatif(str(fresh), [sp.TopFraction(0.5)])
    assert result.remembered == result.no_loss == 0 and result.flips == 0
