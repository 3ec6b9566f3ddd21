import copy
import itertools

import pytest
import torch
from torch.utils.data import default_collate

import siftpipe as sp
from tests.common import loss_field, make_samples, roundtrip, same_state
from tests.contract import PlainList, check_save_load, output_keys

SAMPLES = make_samples(700, seed=3)
BATCHES = [default_collate(SAMPLES[i : i + 48]) for i in range(0, len(SAMPLES), 48)]


POLICIES = {
    "relative": lambda: sp.RelativeProbabilistic(beta=1.0, history=100),
    "top": lambda: sp.TopFraction(0.3),
    "prune": lambda: sp.PruneEasy(ratio=0.5, history=50),
    "uniform": lambda: sp.Uniform(0.4),
}
CUTS = [0, 1, 2, 5, 17, 31, 32, 33, 60, 100, 151, 200, 260, 299, 300]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("output_batch", [None, 7, 40])
def test_per_sample_resume_equals_uninterrupted(policy, output_batch):
    def make():
        return PlainList(
            SAMPLES,
            model=None,
            scorer=loss_field,
            policy=POLICIES[policy](),
            micro_batch=32,
            delay=40,
            seed=5,
            output_batch=output_batch,
        )

    check_save_load(make, CUTS, input_keys=[s["__key__"] for s in SAMPLES])


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("output_batch,micro_batch", [(None, None), (30, None), (100, 16)])
def test_batched_resume_equals_uninterrupted(policy, output_batch, micro_batch):
    def make():
        return PlainList(
            BATCHES,
            model=None,
            scorer=loss_field,
            policy=POLICIES[policy](),
            micro_batch=micro_batch,
            batched=True,
            seed=9,
            output_batch=output_batch,
        )

    check_save_load(make, CUTS[:10], input_keys=[s["__key__"] for s in SAMPLES])


def test_resume_with_a_real_model_does_not_rescore_in_flight_samples():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    scorer = sp.CrossEntropy("x", "y")

    def make():
        return PlainList(
            SAMPLES,
            model=model,
            scorer=scorer,
            policy=sp.RelativeProbabilistic(2.0, 64),
            micro_batch=64,
            seed=1,
        )

    reference = check_save_load(make, [3, 20, 41])
    # the in-flight decisions are replayed, not re-scored: change the weights at the cut and the
    # samples of the checkpoint's micro-batch are still handed on as decided
    first = make()
    it = first.start()
    head = [next(it) for _ in range(3)]
    state = roundtrip(first.state())
    with torch.no_grad():
        model.weight.mul_(-1)
    second = make()
    tail = list(second.resume(state))
    in_flight = [k for k in output_keys(reference) if k < "s000064"]
    assert output_keys(head + tail)[: len(in_flight)] == in_flight


def test_state_survives_weights_only_load_and_holds_no_sample_data():
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 100), micro_batch=32)
    it = s(SAMPLES)
    for _ in range(5):
        next(it)
    state = roundtrip(s.state_dict())

    def leaves(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from leaves(v)
        elif isinstance(x, list | tuple):
            for v in x:
                yield from leaves(v)
        else:
            yield x

    kinds = {type(v) for v in leaves(state)}
    assert kinds <= {int, float, str, bool, type(None), torch.Tensor}
    tensors = [v for v in leaves(state) if isinstance(v, torch.Tensor)]
    assert all(t.dtype in (torch.bool, torch.float32, torch.float64) for t in tensors)
    assert state["consumed"] == 0 and len(state["pending"]) == 1
    assert state["pending"][0]["keys"][:2] == ["s000000", "s000001"]


def test_a_state_with_numpy_scalar_keys_loads_weights_only_and_resumes_exactly():
    """Keys taken from an array (``ids[i]``: np.int64; names: np.str_) were kept in the state as
    numpy scalars, which torch.load's default weights_only=True refuses: every checkpoint of such
    a stage failed to load (found by review, 2026-12-06). They are Python values in the state."""
    import numpy as np

    # (and inside a tuple key: the review of the fix)
    for make_key in (np.int64, lambda i: np.str_(f"k{i:03d}"), lambda i: ("shard-0", np.int64(i))):
        samples = [{**x, "__key__": make_key(i)} for i, x in enumerate(SAMPLES[:200])]

        def make():
            return sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32, seed=3)

        whole = output_keys(make()(samples))
        s = make()
        it = s(samples)
        head = [next(it) for _ in range(5)]
        state = roundtrip(s.state_dict())  # torch.save, then torch.load(weights_only=True)
        assert {type(k) for k in state["pending"][0]["keys"]} <= {int, str, tuple}
        t = make()
        t.load_state_dict(state)
        tail = list(t(samples[t.resume_from or 0 :]))
        assert output_keys(head + tail) == whole


def test_a_batched_key_column_holding_arrays_resumes_exactly():
    """A collated batch's key column as a list holding arrays among integers (two datasets
    mixed): the resume check compared arrays with != and raised a bare "truth value of an array
    is ambiguous", and the state did not load weights_only (found by review, 2026-12-06)."""
    import numpy as np

    data = [
        {
            "loss": torch.tensor([x["loss"] for x in SAMPLES[b : b + 32]]),
            "__key__": [i if i % 2 else np.array([i, i]) for i in range(b, b + 32)],
        }
        for b in range(0, 256, 32)
    ]

    def make():
        return sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=16, seed=3, batched=True)

    whole = [k for b in make()(data) for k in b["__key__"]]
    s = make()
    it = s(data)
    head = [k for _ in range(3) for k in next(it)["__key__"]]
    state = roundtrip(s.state_dict())
    t = make()
    t.load_state_dict(state)
    tail = [k for b in t(data[t.resume_from or 0 :]) for k in b["__key__"]]
    same = [np.array_equal(a, b) for a, b in zip(head + tail, whole, strict=True)]
    assert all(same) and len(head + tail) == len(whole)


def test_resume_from_a_misaligned_source_names_the_fix():
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32)
    it = s(SAMPLES)
    next(it)
    state = roundtrip(s.state_dict())
    t = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32)
    t.load_state_dict(state)
    with pytest.raises(sp.ResumeError, match=r"key 's000001'.*expected 's000000'.*from item 0"):
        list(t(SAMPLES[1:]))
    t.load_state_dict(state)
    with pytest.raises(sp.ResumeError, match="feed it from item 0"):
        list(t(SAMPLES[:10]))


def test_resume_into_another_configuration_is_refused():
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32)
    list(s(SAMPLES[:40]))
    state = s.state_dict()
    with pytest.raises(sp.ResumeError, match="micro_batch=32"):
        sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=16).load_state_dict(state)
    with pytest.raises(sp.ResumeError, match="policy='uniform'"):
        sp.Sifter(None, loss_field, sp.TopFraction(0.5), micro_batch=32).load_state_dict(state)
    with pytest.raises(sp.ResumeError, match="not a siftpipe"):
        sp.Sifter(None, loss_field).load_state_dict({"foo": 1})


def test_checkpoint_between_passes_starts_the_next_pass():
    s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 100), micro_batch=32, seed=2)
    list(s(SAMPLES))
    state = roundtrip(s.state_dict())
    second_pass = output_keys(s(SAMPLES))
    t = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 100), micro_batch=32, seed=2)
    t.load_state_dict(state)
    assert output_keys(t(SAMPLES)) == second_pass
    assert t.epoch == s.epoch == 1
    assert t.stats == s.stats.__class__(
        **{
            **s.stats.__dict__,
            "score_seconds": t.stats.score_seconds,
            "decide_seconds": t.stats.decide_seconds,
        }
    )


def test_resume_in_a_later_pass_counts_consumed_from_that_pass():
    def make():
        return PlainList(
            SAMPLES,
            model=None,
            scorer=loss_field,
            policy=sp.RelativeProbabilistic(1.0, 100),
            micro_batch=32,
            seed=5,
        )

    class SecondPass(PlainList):
        def start(self):
            list(self.sifter(self.data))
            return self.sifter(self.data)

    def make_second():
        return SecondPass(
            SAMPLES,
            model=None,
            scorer=loss_field,
            policy=sp.RelativeProbabilistic(1.0, 100),
            micro_batch=32,
            seed=5,
        )

    check_save_load(make_second, [0, 7, 150])
    first = make_second()
    it = first.start()
    for _ in range(40):
        next(it)
    assert 0 < first.sifter.consumed < len(SAMPLES) and first.sifter.epoch == 1


LIFE = [
    "fresh call, before the first next",
    "resumed call, before the first next",
    "mid micro-batch",
    "after exhaustion",
    "after an abandoned pass",
    "after a closed pass",
    "loaded between passes",
    "second pass, before the first next",
    "set_epoch between passes",
    "a stage that never ran",
    "set_epoch while a pass is open and unread",
    "a second pass called and dropped unstarted",
]


@pytest.mark.parametrize("point", LIFE)
@pytest.mark.parametrize("output_batch", [None, 12])
def test_a_state_taken_at_any_point_of_the_iterators_life_round_trips(point, output_batch):
    def make():
        return sp.Sifter(
            None,
            loss_field,
            sp.RelativeProbabilistic(1.0, 64),
            micro_batch=16,
            output_batch=output_batch,
            seed=3,
        )

    data = SAMPLES[:100]
    a = make()
    live = None  # an iterator of `a` still to be finished
    if point == "fresh call, before the first next":
        live = a(data)
    elif point == "resumed call, before the first next":
        it = a(data)
        next(it)
        state = roundtrip(a.state_dict())
        a = make()
        a.load_state_dict(state)
        live = a(data[state["consumed"] :])
    elif point == "mid micro-batch":
        live = a(data)
        next(live)
    elif point == "after exhaustion":
        list(a(data))
    elif point == "after an abandoned pass":
        for _ in a(data):
            break
    elif point == "after a closed pass":
        it = a(data)
        next(it)
        a.close()
    elif point == "loaded between passes":
        list(a(data))
        state = roundtrip(a.state_dict())
        a = make()
        a.load_state_dict(state)
    elif point == "second pass, before the first next":
        list(a(data))
        live = a(data)
    elif point == "set_epoch between passes":
        list(a(data))
        a.set_epoch(7)
    elif point == "a stage that never ran":
        pass
    elif point == "set_epoch while a pass is open and unread":
        list(a(data))
        live = a(data)
        a.set_epoch(4)
    elif point == "a second pass called and dropped unstarted":
        list(a(data))
        a(data)
    first = roundtrip(a.state_dict())
    same_state(roundtrip(a.state_dict()), first)  # twice in a row: the same

    b = make()
    b.load_state_dict(first)
    same_state(roundtrip(b.state_dict()), first)  # loaded, it says the same again
    if first["pass_open"]:
        b_rest = output_keys(b(data[first["consumed"] :]))
    else:
        b_rest = []
    if live is None and first["pass_open"]:
        live = a(data[first["consumed"] :])  # a pass opened and dropped unstarted: opened again
    a_rest = output_keys(live) if live is not None else []
    assert b_rest == a_rest
    # and the next pass decides alike
    assert output_keys(b(data)) == output_keys(a(data))
    same_state(roundtrip(b.state_dict()), roundtrip(a.state_dict()))
    assert b.epoch == a.epoch


def test_a_checkpoint_after_resuming_but_before_the_first_next_keeps_the_pending_decisions(tmp_path):
    """The issue's case: load, call, checkpoint before next(), resume from that checkpoint: every
    sample is handed on once, as in the uninterrupted run, and the log has one record a sample."""
    data = SAMPLES[:64]

    def make(audit=None):
        return sp.Sifter(
            None, loss_field, sp.Uniform(0.5), micro_batch=16, output_batch=4, seed=1, audit=audit
        )

    reference = output_keys(make()(data))
    log = str(tmp_path / "log")
    a = make(sp.AuditLog(log, run_id="r", writer="thread"))
    it = a(data)
    head = output_keys([next(it)])
    first = roundtrip(a.state_dict())
    a.audit.close()
    b = make(sp.AuditLog(log, writer="thread"))
    b.load_state_dict(first)
    b(data[first["consumed"] :])  # called, never iterated: the job dies here
    second = roundtrip(b.state_dict())
    b.audit.close()
    c = make(sp.AuditLog(log, writer="thread"))
    c.load_state_dict(second)
    tail = output_keys(c(data[second["consumed"] :]))
    c.close()
    assert head + tail == reference
    report = sp.verify_log(log)
    (stream,) = report.streams
    assert report.ok and stream.records == len(data)


def test_an_abandoned_pass_is_not_resumed_by_a_stage_loaded_after_it():
    """After ``break`` the pass is over in this process (the next call starts a new one), so a
    stage loaded with a state taken then starts a new pass too, in the next epoch."""
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=16, seed=1)
    for _ in s(SAMPLES):
        break
    state = roundtrip(s.state_dict())
    assert not state["pass_open"] and state["pending"] == []
    t = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=16, seed=1)
    t.load_state_dict(state)
    assert output_keys(t(SAMPLES)) == output_keys(s(SAMPLES))
    assert t.epoch == s.epoch == 1


@pytest.mark.parametrize("mode", ["micro_batch=1", "batched"])
def test_a_source_fed_from_the_wrong_position_is_caught_at_every_cut(mode):
    """With nothing pending at the cut (every cut with micro_batch=1, every output in batched
    mode without output_batch) the state still names the next item's key, so a source fed from
    one item too early or too late is refused at once."""
    if mode == "batched":
        data = BATCHES[:6]
        kw = dict(batched=True, micro_batch=None)
    else:
        data = SAMPLES[:30]
        kw = dict(micro_batch=1)

    def make():
        return sp.Sifter(None, loss_field, sp.Uniform(0.6), seed=4, **kw)

    n_out = len(list(make()(data)))
    caught = 0
    for cut in range(1, n_out + 1):
        a = make()
        it = a(data)
        for _ in range(cut):
            next(it)
        state = roundtrip(a.state_dict())
        consumed = state["consumed"]
        for wrong in (consumed - 1, consumed + 1):
            if wrong < 0 or wrong > len(data):
                continue
            b = make()
            b.load_state_dict(state)
            with pytest.raises(sp.ResumeError, match="not where the checkpoint left it"):
                list(b(data[wrong:]))
            caught += 1
        b = make()
        b.load_state_dict(state)
        assert len(list(b(data[consumed:]))) == n_out - cut
    assert caught >= 2 * n_out - 1


def test_a_resumed_source_without_keys_is_refused_with_the_fix():
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32)
    it = s(SAMPLES)
    next(it)
    state = roundtrip(s.state_dict())
    t = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32)
    t.load_state_dict(state)
    keyless = [{k: v for k, v in x.items() if k != "__key__"} for x in SAMPLES]
    with pytest.raises(sp.ResumeError, match="have no key '__key__'"):
        list(t(keyless))


def test_a_source_of_ones_own_that_is_a_stateful_source_resumes_from_one_state_dict():
    """The adapter protocol: a source with state_dict/load_state_dict (sp.StatefulSource) is
    tracked, so the stage's state alone puts both back where they were."""

    class Counting:
        def __init__(self, n):
            self.n, self.at = n, 0

        def __iter__(self):
            while self.at < self.n:
                self.at += 1
                yield make_samples(self.n)[self.at - 1]

        def state_dict(self):
            return {"at": self.at}

        def load_state_dict(self, state):
            self.at = state["at"]

    assert isinstance(Counting(1), sp.StatefulSource) and not isinstance([1], sp.StatefulSource)
    whole = [
        s["__key__"]
        for s in sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=4, seed=3)(Counting(40))
    ]
    first = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=4, seed=3)
    it = first(Counting(40))
    head = [next(it)["__key__"] for _ in range(7)]
    state = roundtrip(first.state_dict())
    assert state["source"] is not None  # the source's position is inside the stage's state
    second = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=4, seed=3)
    second.load_state_dict(state)
    assert head + [s["__key__"] for s in second(Counting(40))] == whole


def test_a_source_that_fails_while_a_resumed_pass_re_reads_its_pending_samples_raises_its_error():
    """The source's own error (a connection reset), not a ResumeError blaming the position: a
    read that fails partway returns what came before it, and the re-read must not take that for
    a source of another shape (found by review)."""
    samples = make_samples(60, seed=4)
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10, seed=1)
    it = s(samples)
    next(it)  # a group decided, most of it not handed on yet
    state = roundtrip(s.state_dict())
    assert state["pending"]

    def broken():
        yield from samples[state["consumed"] : state["consumed"] + 3]
        raise ConnectionResetError("the storage reset the connection")

    again = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=10, seed=1)
    again.load_state_dict(state)
    with pytest.raises(ConnectionResetError, match="reset the connection"):
        list(again(broken()))


@pytest.mark.parametrize("batched", [False, True], ids=["per_sample", "batched"])
def test_a_checkpoint_taken_as_a_failing_pass_hands_on_its_last_rows_resumes_from_the_failure(batched):
    """A source that raises: the pass first hands on the rows it held (a short output batch),
    and a checkpoint taken then read one item ahead, met the failed generator's end and
    recorded that the source had ended, so the resume fed from the failed item was refused as
    "the checkpoint's source had ended" (found by review, 2026-12-05)."""
    samples = [{"__key__": f"k{i}", "loss": float((i * 37) % 11) + 0.1} for i in range(60)]

    def make():
        mode = {"batched": True, "micro_batch": None} if batched else {"micro_batch": 8}
        return sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, history=20), output_batch=3,
                         seed=0, **mode)  # fmt: skip

    def feed(items):
        if not batched:
            return items
        return [default_collate(items[i : i + 4]) for i in range(0, len(items), 4)]

    def failing(at):
        yield from feed(samples)[:at]
        raise OSError(f"reading item {at} failed")

    whole = [k for batch in make()(feed(samples)) for k in batch["__key__"]]
    fail_at = 10 if batched else 40
    stage, trained, state = make(), [], None
    with pytest.raises(OSError, match="failed"):
        for batch in stage(failing(fail_at)):
            trained += batch["__key__"]
            state = roundtrip(stage.state_dict())
    assert state is not None and not state["ended"] and state["consumed"] == fail_at
    again = make()
    again.load_state_dict(state)
    trained += [k for batch in again(feed(samples)[fail_at:]) for k in batch["__key__"]]
    assert trained == whole


def test_a_batched_resume_fed_from_the_wrong_batch_is_refused_by_the_next_batchs_key():
    """The check of a batch's key count read a checkpoint's next batch as one row: its keys
    "did not match", the next key was recorded as unknown, and a resume fed from the wrong
    batch was accepted, the skipped rows never trained (the review of that check, 2026-12-05)."""
    batches = [{"__key__": [f"k{4 * b + i}" for i in range(4)], "loss": torch.rand(4)} for b in range(6)]

    def make():
        return sp.Sifter(None, loss_field, sp.Uniform(1.0), batched=True, micro_batch=None, seed=0)

    stage = make()
    it = iter(stage(batches))
    next(it), next(it)
    state = roundtrip(stage.state_dict())
    assert state["next_key"] == "k8" and not state["pending"]
    wrong = make()
    wrong.load_state_dict(state)
    with pytest.raises(sp.ResumeError, match="its next item has key 'k12', the checkpoint expected 'k8'"):
        list(wrong(batches[3:]))
    right = make()
    right.load_state_dict(state)
    assert [k for b in right(batches[2:]) for k in b["__key__"]] == [f"k{i}" for i in range(8, 24)]


def _prefetched(batches, depth):
    """A same-thread prefetcher ``depth`` batches ahead (as one that moves batches to the GPU)."""
    import collections

    ahead: collections.deque = collections.deque()
    for batch in batches:
        ahead.append(batch)
        if len(ahead) > depth:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()


def _keys_of(batch):
    return [str(k) for k in batch["__key__"]]


@pytest.mark.parametrize(
    "batched, output_batch", [(True, None), (True, 16), (False, 16), (False, 5)], ids=str
)
def test_a_state_taken_behind_a_prefetcher_resumes_before_the_batches_it_held(
    tmp_path, batched, output_batch
):
    """A prefetcher between the stage and the step holds batches the step has not trained: a
    plain state_dict() records them as handed on, so a resumed job never trains them.
    state_dict(held=k) with Sifter(hold=k) resumes before them: the job trains exactly what the
    uninterrupted one does, and its audit log reads as kept exactly what was trained."""
    data = BATCHES if batched else SAMPLES[:400]
    depth = 2

    def make(root):
        return sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 100),
                         micro_batch=None if batched else 32, batched=batched,
                         output_batch=output_batch, hold=depth, seed=5,
                         audit=sp.AuditLog(root, run_id="r"))  # fmt: skip

    reference = make(str(tmp_path / "ref"))
    expected = [_keys_of(b) for b in reference(data)]
    reference.close()
    assert len(expected) > 8
    for cut in (1, 3, len(expected) // 2, len(expected) - depth - 1):
        root = str(tmp_path / f"cut{cut}")
        s = make(root)
        trained = []
        for batch in _prefetched(s(data), depth):
            trained.append(_keys_of(batch))
            if len(trained) == cut:
                state = roundtrip(s.state_dict(held=depth))  # the prefetcher holds `depth`
                break
        s.audit.flush()  # killed here: the next attempt resumes from the state
        s = make(root)
        s.load_state_dict(state)
        source = data[s.resume_from or 0 :]
        trained += [_keys_of(b) for b in _prefetched(s(source), depth)]
        s.close()
        assert trained == expected, cut
        table = sp.read_log(root)
        kept = sorted(k for k, keep in zip(*(table.column(c).to_pylist() for c in ("key", "kept"))) if keep)
        assert kept == sorted(k for b in trained for k in b), cut


def test_a_state_that_cannot_resume_before_held_batches_is_refused():
    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=None, batched=True, hold=1, seed=5)
    with pytest.raises(sp.SiftError, match="no pass is open"):
        s.state_dict(held=1)
    it = s(BATCHES)
    next(it)
    with pytest.raises(sp.SiftError, match=r"Sifter\(..., hold=2\)"):
        s.state_dict(held=2)
    assert s.state_dict(held=1)["emitted"] == 0  # the batch handed on is handed on again
    list(it)  # a prefetcher read the pass to its end
    with pytest.raises(sp.SiftError, match="no pass is open"):
        s.state_dict(held=1)
    with pytest.raises(sp.ConfigError, match="needs output_batch"):
        sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=32, hold=2)  # single samples
    for hold in (-1, 65, 1.5, True):
        with pytest.raises(sp.ConfigError, match="hold is a number of batches from 0 to 64"):
            sp.Sifter(None, loss_field, sp.Uniform(0.5), hold=hold)


def _shards(order, batched, where="s3://b/"):
    """Shards that number their samples alike (keys 000..039 in each), in ``order``: as samples,
    or as input batches of 10 (a WebDataset chain's per-shard keys)."""
    samples = [
        {
            "__key__": f"{i:03d}",
            "__url__": f"{where}shard-{s}.tar",
            "loss": torch.tensor(float((7 * i + s) % 10)),
        }
        for s in order
        for i in range(40)
    ]
    if not batched:
        return samples
    return [default_collate(samples[i : i + 10]) for i in range(0, len(samples), 10)]


@pytest.mark.parametrize("batched", [False, True], ids=["pending groups", "the next item"])
def test_a_source_whose_shards_come_in_another_order_is_refused_where_keys_alone_match(batched, tmp_path):
    # the checkpoint records the shard each sample came from: a resumed source read in another
    # shard order (a shard shuffle with no seed) gives the same keys at the same positions there
    def make():
        return sp.Sifter(
            None, loss_field, sp.Uniform(0.5), micro_batch=None if batched else 16, batched=batched
        )

    s = make()
    it = s(_shards([0, 1, 2], batched))
    for _ in range(2 if batched else 9):
        next(it)
    state = roundtrip(s.state_dict())
    assert (state["next_shard"] is not None) == batched and bool(state["pending"]) != batched
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.raises(sp.ResumeError, match=r"from shard 'shard-1.tar', the checkpoint's.*'shard-0.tar'"):
        list(resumed(_shards([1, 0, 2], batched)[state["consumed"] :]))
    # the same shards elsewhere (another mount point, presigned URLs signed again): the same
    # shards, so the resume goes on exactly
    moved = "https://cdn.example/v2/"
    same = make()
    same.load_state_dict(state)
    rest = list(same(_shards([0, 1, 2], batched, moved)[state["consumed"] :]))
    assert output_keys(rest) == output_keys(list(it))


def test_a_state_asked_for_while_another_thread_decides_a_group_is_refused_then_not_later():
    """A checkpoint thread took state_dict() while the reading thread was inside the scorer: the
    state held scored 1 of 0 seen and was refused as damaged only when loaded (found by review,
    2026-12-05). Now it is refused when asked for, and taken between items it loads."""
    import threading

    inside, release = threading.Event(), threading.Event()

    def scorer(model, batch):
        inside.set()
        assert release.wait(30)
        return batch["loss"].double()

    s = sp.Sifter(None, scorer, sp.Uniform(0.6), micro_batch=4, seed=0)
    passes = s(make_samples(16))
    reader = threading.Thread(target=lambda: next(passes))
    reader.start()
    try:
        assert inside.wait(30)
        with pytest.raises(sp.PassClosedError, match="take the state between items"):
            s.state_dict()
    finally:
        release.set()
        reader.join(30)
    state = roundtrip(s.state_dict())  # between items: whole
    again = sp.Sifter(None, scorer, sp.Uniform(0.6), micro_batch=4, seed=0)
    again.load_state_dict(state)
    assert again.stats.seen == s.stats.seen == 4
    passes.close()


@pytest.mark.parametrize("batched", [False, True], ids=["samples", "batches"])
def test_a_read_that_begins_and_ends_while_the_state_is_taken_is_refused(batched):
    """Neither check saw the reading thread inside next(): a read that began after the first and
    ended before the second gave a state whose entries described two moments (found by review,
    2026-12-05; README called it a limit). What a read moves is compared too now."""
    import threading

    class Reading(sp.Uniform):
        """Its state is taken while another thread reads the pass once, start to end."""

        passes = None

        def state_dict(self):
            if self.passes is not None:
                reader = threading.Thread(target=lambda: next(self.passes))
                reader.start()
                reader.join(30)
            return super().state_dict()

    def make():
        if batched:
            return sp.Sifter(None, loss_field, Reading(0.6), micro_batch=None, batched=True, seed=0)
        return sp.Sifter(None, loss_field, Reading(0.6), micro_batch=4, seed=0)

    samples = make_samples(64)
    data = [default_collate(samples[i : i + 8]) for i in range(0, 64, 8)] if batched else samples
    s = make()
    passes = s(data)
    next(passes)
    s.policy.passes = passes
    with pytest.raises(sp.PassClosedError, match="while its state was being taken"):
        s.state_dict()
    s.policy.passes = None
    state = roundtrip(s.state_dict())  # between items, nothing reading: whole, and it resumes
    again = make()
    again.load_state_dict(state)
    rest = list(again(data[again.resume_from :]))
    assert len(list(passes)) == len(rest)
    assert again.stats.seen == s.stats.seen


def test_a_keyboard_interrupt_in_the_scorer_leaves_consumed_at_what_was_decided():
    """A KeyboardInterrupt (not an Exception) from the scorer left its undecided group pending:
    consumed read 12 where 8 samples were seen (found by review, 2026-12-05)."""
    calls = {"n": 0}

    def scorer(model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return batch["loss"].double()

    s = sp.Sifter(None, scorer, sp.Uniform(0.7), micro_batch=4, seed=0)
    with pytest.raises(KeyboardInterrupt):
        list(s(make_samples(40)))
    assert s.stats.seen == 8 and s.consumed == 8


def test_model_version_and_epoch_are_checked_when_set_so_every_state_written_loads(tmp_path):
    """A str or None model_version ran a whole pass and lost every audit record at close(); a
    tensor step (Adam's) or a numpy integer, and set_epoch(-1), made states that would not load
    (found by review, 2026-12-05). Integers of any kind and whole-number tensors are taken as
    ints; anything else is refused when set."""
    import numpy as np

    s = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=8, audit=str(tmp_path / "log"))
    for value, want in ((torch.tensor(3.0), 3), (np.int64(5), 5), (torch.tensor(7), 7), (9, 9)):
        s.model_version = value
        assert s.model_version == want and type(s.model_version) is int
    for bad in (
        "step-5",
        None,
        1.5,
        True,
        np.bool_(True),
        torch.tensor(True),
        2**63,
        float("nan"),
        torch.zeros(2),
    ):
        with pytest.raises(sp.ConfigError, match="model_version"):
            s.model_version = bad
    for bad in (-1, 1.5, "7", None, True, torch.tensor(True)):
        with pytest.raises(sp.ConfigError, match="pass number"):
            s.set_epoch(bad)
        with pytest.raises(sp.ConfigError, match="pass number"):
            s.epoch = bad
    s.set_epoch(np.int64(2))
    s.model_version = torch.tensor(12.0)
    out = list(s(make_samples(40)))
    state = roundtrip(s.state_dict())
    s.close()
    again = sp.Sifter(None, loss_field, sp.Uniform(0.5), micro_batch=8)
    again.load_state_dict(state)
    assert (again.epoch, again.model_version) == (2, 12)
    log = sp.read_log(str(tmp_path / "log"))
    assert log.num_rows == 40 and sum(log.column("kept").to_pylist()) == len(out)
    assert set(log.column("model_version").to_pylist()) == {12}


def test_held_beyond_the_batches_the_stage_remembers_is_refused_though_hold_was_raised_later():
    """hold set after construction is not checked; past the 64 batches the stage remembers,
    state_dict(held=70) was taken, resuming before fewer batches than it said (found by review,
    2026-12-05)."""
    s = sp.Sifter(None, loss_field, sp.Uniform(1.0), micro_batch=4, output_batch=2, hold=2)
    s.hold = 99
    it = s(make_samples(400))
    for _ in range(150):
        next(it)
    with pytest.raises(sp.SiftError, match="held=70.*at most 64"):
        s.state_dict(held=70)
    s.state_dict(held=64)  # what it remembers: fine


def test_a_merged_reference_is_of_its_pass_and_a_state_taken_as_the_next_opens_resumes_exactly():
    """A loss history merged across ranks (sp.sync_history sets the policy's reference) decides
    until the pass ends; a new pass decides by the rank's own window until its next sync (found by
    review, 2026-12-05: kept on, it decided every later epoch). Cleared as the pass opens, so a
    state taken right after sifter(...) and before its first item resumes as the run goes on
    (the review of a first version, which cleared it in EqualSteps' first step)."""
    import numpy as np

    def run(cut: bool):
        s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, seed=3)
        list(s(make_samples(100, seed=1)))
        s.policy.set_reference(np.array([100.0, 200.0]), np.array([50.0, 50.0]))  # as a sync does
        assert s.policy.merged
        stream = s(make_samples(100, seed=2))
        assert not s.policy.merged  # the new pass: its own window
        if cut:
            state = roundtrip(s.state_dict())
            s = sp.Sifter(None, loss_field, sp.RelativeProbabilistic(1.0, 50), micro_batch=10, seed=3)
            s.load_state_dict(state)
            stream = s(make_samples(100, seed=2))
        return [x["__key__"] for x in stream]

    whole = run(False)
    assert 20 < len(whole) < 80  # by the window: about half kept, not the reference's 0
    assert run(True) == whole


@pytest.mark.parametrize("kind", ["dict", "UserDict", "tuple"])
def test_a_resumed_batched_pass_cuts_row_tuples_as_the_first_read_did(kind):
    """A group re-read on resume went through the row check (which marks per-row tuples) only for
    a plain dict: a UserDict's or a tuple batch's tuple of ids came out uncut after a resume
    (found by review, 2026-12-05)."""
    from collections import UserDict

    def scorer(m, b):
        x = b[0] if isinstance(b, tuple) else b["x"]
        return (x[:, 0] * 7 % 5).float()

    def make(i):
        x, ids = torch.arange(4.0)[:, None] + 4 * i, tuple(range(4 * i, 4 * i + 4))
        return (
            (x, ids) if kind == "tuple" else {"dict": dict, "UserDict": UserDict}[kind]({"x": x, "ids": ids})
        )

    def seen(out):
        x, ids = out if isinstance(out, tuple) else (out["x"], out["ids"])
        return x[:, 0].long().tolist(), tuple(ids)

    def new():
        return sp.Sifter(None, scorer, sp.TopFraction(0.5), batched=True, key=None, seed=1, hold=4)

    data = [make(i) for i in range(4)]
    whole = [seen(out) for out in new()(data)]
    assert all(x == list(ids) for x, ids in whole)
    first = new()
    stream = first(data)
    next(stream)
    resumed = new()
    resumed.load_state_dict(roundtrip(first.state_dict(held=1)))  # the batch held is not trained
    assert [seen(out) for out in resumed(data[resumed.resume_from or 0 :])] == whole


def test_a_tracked_loader_resumed_with_another_batch_size_is_refused_naming_both_sizes():
    """A tracked loader (the stage repositions it) resumed with another batch size was told
    "of another size; feed it from item 1", which is no fix for a tracked source and named
    neither size (found by review, 2026-12-06)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = [{"__key__": f"s{i:03d}", "loss": float(i % 7)} for i in range(60)]

    def sifter():
        # output batches of 5 rows: a checkpoint after the first leaves the batch's rest pending
        return sp.Sifter(None, loss_field, sp.Uniform(1.0), batched=True, micro_batch=None, output_batch=5)

    s = sifter()
    it = s(StatefulDataLoader(data, batch_size=12))
    next(it)
    state = roundtrip(s.state_dict())
    t = sifter()
    t.load_state_dict(state)
    with pytest.raises(
        sp.ResumeError, match=r"of 12 rows, but the source gave one of 10.*feed the loader whole"
    ):
        list(t(StatefulDataLoader(data, batch_size=10)))


@pytest.mark.parametrize("batched", [False, True])
def test_a_consumer_that_changes_keys_in_place_does_not_break_a_resume(batched):
    """A training loop (or a torchdata Mapper) that renames a sample's key in place after the
    stage handed it on: the state read the pending rows' keys afterwards and every resume was
    refused (found by review, 2026-12-06, after the same fix for webdataset's .map_dict). Keys
    are taken as each group is read."""
    samples = make_samples(240, seed=5)
    if batched:
        source = [
            {
                "__key__": [s["__key__"] for s in samples[i : i + 16]],
                "loss": torch.tensor([float(s["loss"]) for s in samples[i : i + 16]]),
            }
            for i in range(0, 240, 16)
        ]
    else:
        source = samples

    def stage():
        micro = None if batched else 8
        return sp.Sifter(None, loss_field, sp.Uniform(0.75), micro_batch=micro, batched=batched, seed=3)

    def consume(items):
        out = []
        for item in items:
            if batched:
                item["__key__"] = ["train/" + k for k in item["__key__"]]  # a new column, in place
                out += item["__key__"]
            else:
                item["__key__"] = "train/" + item["__key__"]
                out.append(item["__key__"])
        return out

    whole = consume(stage()(copy.deepcopy(source)))
    for cut in (1, 3, 7):
        data = copy.deepcopy(source)
        s = stage()
        it = s(data)
        head = consume(itertools.islice(it, cut))
        state = roundtrip(s.state_dict())
        del it
        again = stage()
        again.load_state_dict(state)
        rest = consume(again(copy.deepcopy(source)[state["consumed"] :]))
        assert head + rest == whole, cut


def test_a_consumer_that_changes_a_tensor_key_column_in_place_does_not_break_a_resume():
    """The batched stage hands on views of a batch's key tensor when it keeps every row: a
    consumer's ``batch["__key__"] += n`` changed the column the stage had noted (the review of
    the keys noted as read, 2026-12-06). The stage keeps a copy of the column."""
    source = [
        {
            "__key__": torch.arange(i, i + 16),
            "loss": torch.rand(16, generator=torch.Generator().manual_seed(i)),
        }
        for i in range(0, 240, 16)
    ]

    def stage():
        return sp.Sifter(
            None, loss_field, sp.Uniform(1.0), micro_batch=None, batched=True, output_batch=5, seed=3
        )

    def consume(items):
        out = []
        for item in items:
            item["__key__"] += 100_000
            out += item["__key__"].tolist()
        return out

    whole = consume(stage()(copy.deepcopy(source)))
    for cut in (1, 3, 7):
        s = stage()
        it = s(copy.deepcopy(source))
        head = consume(itertools.islice(it, cut))
        state = roundtrip(s.state_dict())
        del it
        again = stage()
        again.load_state_dict(state)
        assert head + consume(again(copy.deepcopy(source)[state["consumed"] :])) == whole, cut
