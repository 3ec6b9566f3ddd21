"""siftpipe.core.scoring: the stage's scoring part on its own (no Sifter, no pass): one float64
loss per row, in micro-batches, in eval mode without grad, with the scorer's output checked and
out-of-memory errors split in halves when asked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import siftpipe as sp
from siftpipe.core.ledger import Group
from siftpipe.core.modes import eval_scored
from siftpipe.core.scoring import Scoring
from siftpipe.errors import ScorerError, ScorerOutputError


def names(at: np.ndarray) -> list[str]:
    return [f"k{i}" for i in at.tolist()]


def samples(n: int) -> list[dict]:
    return [{"x": torch.tensor([float(i)]), "loss": torch.tensor(float(i))} for i in range(n)]


def carried(model, batch):
    """Each row's loss is the value it carries: what was scored is visible in the result."""
    return batch["loss"].double()


class Recorder(nn.Module):
    """Records, on each forward, the mode it ran in and how many rows it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool, bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), len(x)))
        return x[:, 0]


def test_per_sample_rows_are_collated_scored_and_returned_as_float64():
    scoring = Scoring(None, carried, micro_batch=4)
    group = Group(samples(4), rows=4, seq0=100, snapshot=None)
    losses = scoring.rows(group, None, names)
    assert losses.dtype == np.float64 and losses.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert scoring.rows(group, np.array([3, 1]), names).tolist() == [3.0, 1.0]


def test_a_short_micro_batch_is_padded_to_the_fixed_size_and_the_padding_dropped():
    shapes = []

    def scorer(model, batch):
        shapes.append(len(batch["loss"]))
        return batch["loss"].double()

    scoring = Scoring(None, scorer, micro_batch=8, pad_micro_batch=True)
    group = Group(samples(3), rows=3, seq0=0, snapshot=None)
    assert scoring.rows(group, None, names).tolist() == [0.0, 1.0, 2.0]
    assert shapes == [8]


def test_a_batched_group_is_scored_in_micro_batches_of_rows():
    rows = []

    def scorer(model, batch):
        rows.append(len(batch["loss"]))
        return batch["loss"].double()

    batch = {"loss": torch.arange(10, dtype=torch.float32)}
    scoring = Scoring(None, scorer, micro_batch=4, batched=True)
    group = Group([batch], rows=10, seq0=0, snapshot=None)
    assert scoring.rows(group, None, names).tolist() == list(map(float, range(10)))
    assert rows == [4, 4, 2]
    rows.clear()
    assert scoring.rows(group, np.array([9, 0, 5]), names).tolist() == [9.0, 0.0, 5.0]
    assert rows == [3]


def test_the_forward_runs_in_eval_mode_without_grad_and_the_models_mode_comes_back():
    model = Recorder().train()
    scoring = Scoring(model, lambda m, b: m(b["x"]), micro_batch=2)
    scoring.rows(Group(samples(2), rows=2, seq0=0, snapshot=None), None, names)
    assert model.seen == [(False, False, False, 2)] and model.training
    model.seen.clear()
    keep_mode = Scoring(model, lambda m, b: m(b["x"]), micro_batch=2, eval_mode=False)
    keep_mode.rows(Group(samples(2), rows=2, seq0=0, snapshot=None), None, names)
    assert model.seen == [(True, False, False, 2)] and model.training


def test_what_the_first_forward_makes_in_the_model_stays_trainable():
    """The scoring forward is often the model's first. Under inference_mode a lazy module's
    weights, made then, were inference tensors: never trained, no error (found by review). Under
    no_grad they are ordinary parameters the training step trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(3))
    scoring = Scoring(model, lambda m, b: m(b["x"]).sum(1), micro_batch=2)
    group = Group([{"x": torch.randn(4)} for _ in range(2)], rows=2, seq0=0, snapshot=None)
    scoring.rows(group, None, names)
    weight = model[0].weight
    assert not weight.is_inference()
    before = weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).pow(2).sum().backward()
    optimizer.step()
    assert weight.grad is not None and not torch.equal(weight.detach(), before)


def test_the_models_mode_comes_back_when_the_scorer_raises():
    model = Recorder().train()

    def broken(m, b):
        raise ValueError("no such field")

    scoring = Scoring(model, broken, micro_batch=2)
    with pytest.raises(
        ScorerError, match=r"raised ValueError: no such field .* at seq 7 \(keys \['k0', 'k1'\]\)"
    ):
        scoring.rows(Group(samples(2), rows=2, seq0=7, snapshot=None), None, names)
    assert model.training


@pytest.mark.parametrize(
    "output, expected",
    [
        (lambda b: [0.0, 1.0], "returned a list .* it must return a torch.Tensor of shape \\[2\\]"),
        (lambda b: b["loss"].reshape(2, 1), "returned shape \\[2, 1\\] .* use reduction='none'"),
        (lambda b: b["loss"][:1], "returned shape \\[1\\] .* exactly one loss per sample"),
        (lambda b: b["loss"].long(), "returned dtype torch.int64 .* \\(return loss.float\\(\\)\\)"),
        # loss.float() of a complex tensor drops its imaginary part (found by review, 2026-12-06)
        (lambda b: b["loss"].to(torch.complex64), "returned complex losses .*\\(loss.abs\\(\\) or loss.real"),
    ],
)
def test_a_wrong_scorer_output_is_an_error_naming_the_micro_batch_and_the_fix(output, expected):
    scoring = Scoring(None, lambda m, b: output(b), micro_batch=2)
    with pytest.raises(ScorerOutputError, match=expected) as caught:
        scoring.rows(Group(samples(2), rows=2, seq0=40, snapshot=None), None, names)
    assert "micro-batch at sample seq 40" in str(caught.value)


def test_a_batch_that_cannot_be_collated_names_its_keys_and_the_fix():
    scoring = Scoring(None, carried, micro_batch=2)
    group = Group([{"loss": torch.tensor(1.0)}, {"other": 1}], rows=2, seq0=5, snapshot=None)
    with pytest.raises(
        ScorerError, match=r"collating micro-batch at sample seq 5 \(keys \['k0', 'k1'\]\).*collate_fn"
    ):
        scoring.rows(group, None, names)


def test_losses_that_need_grad_come_back_detached():
    scoring = Scoring(None, lambda m, b: b["loss"].requires_grad_(), micro_batch=2)
    with torch.inference_mode(False):
        losses = scoring.rows(Group(samples(2), rows=2, seq0=0, snapshot=None), None, names)
    assert losses.tolist() == [0.0, 1.0]


def test_out_of_memory_is_split_in_halves_when_asked_and_named_when_not():
    """A scorer that runs out of memory above 2 rows: with on_oom='split' each row is scored
    once, in halves, in order; by default the error says how to split."""
    seen = []

    def scorer(model, batch):
        if len(batch["loss"]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        seen.append(batch["loss"].tolist())
        return batch["loss"].double()

    group = Group(samples(7), rows=7, seq0=0, snapshot=None)
    split = Scoring(None, scorer, micro_batch=7, on_oom="split")
    assert split.rows(group, None, names).tolist() == list(map(float, range(7)))
    assert [v for part in seen for v in part] == list(map(float, range(7)))
    with pytest.raises(ScorerError, match="on_oom='split'"):
        Scoring(None, scorer, micro_batch=7).rows(group, None, names)


def modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


class ModeProbe(nn.Module):
    """A model whose forward records every module's mode while it scores."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))
        self.during: list[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.during.append(modes(self))
        return self.body(x)[:, 0]


def test_a_layer_the_user_froze_stays_frozen_after_scoring():
    # fine-tuning with frozen batch-norm statistics: the model trains, one layer is in eval mode;
    # model.eval() then model.train() would unfreeze it, and training would update its statistics
    model = ModeProbe().train()
    model.body[1].eval()
    before = modes(model)
    stats = model.body[1].running_mean.clone()
    scoring = Scoring(model, lambda m, b: m(b["x"]), micro_batch=4)
    scoring.rows(Group(samples(4), rows=4, seq0=0, snapshot=None), None, names)
    assert model.during == [[False] * len(before)]  # every module scored in eval mode
    assert modes(model) == before and model.body[1].training is False
    assert torch.equal(model.body[1].running_mean, stats)


def test_a_module_with_its_own_train_method_is_switched_through_it_both_ways():
    class Merging(nn.Linear):
        """Like an adapter layer that merges its weights on eval() and unmerges on train()."""

        merged = False

        def train(self, mode: bool = True):
            super().train(mode)
            self.merged = not mode
            return self

    model = nn.Sequential(nn.Linear(1, 1), Merging(1, 1), nn.Sequential(nn.Dropout(), nn.BatchNorm1d(1)))
    model[2][1].eval()  # a frozen layer beside it
    seen = []

    def scorer(m, b):
        seen.append((m[1].merged, modes(m)))
        return m(b["x"])[:, 0]

    before = modes(model)
    Scoring(model, scorer, micro_batch=4).rows(Group(samples(4), rows=4, seq0=0, snapshot=None), None, names)
    assert seen == [(True, [False] * len(before))]
    assert model[1].merged is False and modes(model) == before


def test_a_model_already_in_eval_mode_is_left_alone_and_a_raising_scorer_restores_modes():
    model = ModeProbe().eval()
    Scoring(model, lambda m, b: m(b["x"]), micro_batch=4).rows(
        Group(samples(4), rows=4, seq0=0, snapshot=None), None, names
    )
    assert not any(modes(model))
    model.train()
    model.body[2].eval()
    before = modes(model)

    def broken(m, b):
        raise ValueError("boom")

    with pytest.raises(ScorerError):
        Scoring(model, broken, micro_batch=4).rows(
            Group(samples(4), rows=4, seq0=0, snapshot=None), None, names
        )
    assert modes(model) == before


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_shared_module_and_a_torchscript_model_are_switched_and_restored():
    shared = nn.Dropout(0.9)
    model = nn.Sequential(nn.Linear(1, 1), shared, nn.Sequential(shared, nn.Linear(1, 1))).train()
    during = []
    Scoring(model, lambda m, b: (during.append(modes(m)), m(b["x"])[:, 0])[1], micro_batch=4).rows(
        Group(samples(4), rows=4, seq0=0, snapshot=None), None, names
    )
    assert during == [[False] * len(modes(model))] and all(modes(model))

    torch.manual_seed(0)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.9), nn.Linear(8, 1))).train()
    scoring = Scoring(scripted, lambda m, b: m(b["x"])[:, 0], micro_batch=4)
    group = Group(samples(4), rows=4, seq0=0, snapshot=None)
    first, second = scoring.rows(group, None, names), scoring.rows(group, None, names)
    assert np.array_equal(first, second)  # dropout off while scoring: the same losses twice
    assert scripted.training and scripted[1].training


def test_a_module_registered_inside_its_own_subtree_is_switched_once_and_does_not_loop():
    model = nn.Sequential(nn.Linear(1, 1), nn.Dropout()).train()
    model[1].add_module("back", model)  # a cycle, as model.modules() tolerates
    model[0].eval()
    during = []

    def scorer(m, b):
        during.append([m.training, m[0].training, m[1].training])
        return m[0](b["x"])[:, 0]

    Scoring(model, scorer, micro_batch=4).rows(Group(samples(4), rows=4, seq0=0, snapshot=None), None, names)
    assert during == [[False, False, False]]
    assert [model.training, model[0].training, model[1].training] == [True, False, True]


def test_a_model_in_eval_mode_is_put_back_in_it_when_the_scorer_switches_it_to_training():
    # found by review (2026-12-05): with every module in eval mode there was nothing to undo, so a
    # scorer that called model.train() left dropout and batch norm in training mode afterwards
    model = ModeProbe().eval()

    def switches(m, b):
        m.train()
        return m(b["x"])

    for raising in (False, True):

        def scorer(m, b, raising=raising):
            out = switches(m, b)
            if raising:
                raise ValueError("boom")
            return out

        try:
            Scoring(model, scorer, micro_batch=4).rows(
                Group(samples(4), rows=4, seq0=0, snapshot=None), None, names
            )
        except ScorerError:
            assert raising
        assert not any(modes(model)), raising


def test_a_model_in_eval_mode_whose_dropout_the_scorer_switches_on_is_put_back_in_eval_mode():
    """MC-dropout scoring switches only the dropout layers to training mode. With every module in
    eval mode (a model fine-tuned in eval mode) only a root switched to training was looked at,
    so dropout stayed on for the user's training steps, nothing said (found by review,
    2026-12-06)."""
    model = ModeProbe().eval()

    def mc_dropout(m, b):
        for module in m.modules():
            if isinstance(module, nn.Dropout):
                module.train()
        return m(b["x"])

    Scoring(model, mc_dropout, micro_batch=4).rows(
        Group(samples(4), rows=4, seq0=0, snapshot=None), None, names
    )
    assert not any(modes(model))
    assert model.during == [[isinstance(m, nn.Dropout) for m in model.modules()]]
    with eval_scored(model):  # a scorer's own model (a proxy): the same way back
        model.body[2].train()
    assert not any(modes(model))


@pytest.mark.parametrize("batched", [False, True])
def test_losses_a_scorer_writes_into_a_buffer_it_reuses_stay_each_micro_batchs_own(tmp_path, batched):
    """A float64 CPU tensor's numpy() shares its memory: a scorer that reuses one buffer for each
    micro-batch had every chunk of a batch read the last chunk's losses, and the audit log,
    which keeps the losses until it seals a part, record the last micro-batch's for every row
    (found by review, 2026-12-05)."""
    import siftpipe as sp

    buffer = torch.zeros(4, dtype=torch.float64)

    def reusing(model, batch):
        n = len(batch["loss"])
        buffer[:n].copy_(batch["loss"])
        return buffer[:n]

    losses = torch.tensor([3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0, 6.0, 5.5, 3.5, 0.5, 8.0], dtype=torch.float64)
    if batched:
        data = [{"__key__": torch.arange(12), "loss": losses}]
    else:
        data = [{"__key__": i, "loss": losses[i]} for i in range(12)]
    log = sp.AuditLog(str(tmp_path), flush_every=1000)
    s = sp.Sifter(None, reusing, sp.TopFraction(0.5), micro_batch=4, batched=batched, audit=log)
    out = list(s(data))
    s.close()
    kept = sorted(int(k) for o in out for k in (o["__key__"].tolist() if batched else [o["__key__"]]))
    table = sp.read_log(str(tmp_path))
    logged = dict(zip(table.column("seq").to_pylist(), table.column("loss").to_pylist(), strict=True))
    assert [logged[i] for i in range(12)] == losses.tolist()
    # the top half of each micro-batch of 4
    assert kept == [0, 2, 5, 7, 8, 11]


def test_one_model_scored_from_two_threads_at_once_is_refused_and_its_mode_comes_back():
    """Two Sifters over one model, each read in its own thread: their eval-mode switches
    interleaved, one thread found nothing to undo while the other had switched the model, and
    the model went on training in eval mode (dropout off), some batches scored in training
    mode (found by review, 2026-12-05). A second thread scoring a model another thread scores
    now is refused; the first thread's forward and the model's mode are untouched."""
    import threading

    import siftpipe as sp

    inside, go_on = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 4)
            self.drop = nn.Dropout(0.5)
            self.modes = []

        def forward(self, x):
            self.modes.append(self.training)
            if threading.current_thread().name == "first" and not inside.is_set():
                inside.set()
                assert go_on.wait(30)
            return self.drop(self.lin(x))

    model = Slow().train()
    data = [{"__key__": f"k{i}", "x": torch.randn(3), "y": torch.tensor(i % 4)} for i in range(8)]
    errors = {}

    def job(name):
        stage = sp.Sifter(model, sp.CrossEntropy("x", "y"), sp.Uniform(0.5), micro_batch=4, seed=1)
        try:
            list(stage(data))
        except Exception as exc:
            errors[name] = exc

    first = threading.Thread(target=job, args=("first",), name="first")
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=job, args=("second",), name="second")
    second.start()
    second.join(30)
    go_on.set()
    first.join(30)
    assert "first" not in errors
    assert isinstance(errors["second"], sp.SiftError) and "being scored in thread 'first'" in str(
        errors["second"]
    )
    assert model.training and model.drop.training and not any(model.modes)


def test_scoring_in_another_autocast_dtype_inside_the_loops_own_autocast_leaves_its_casts_alone():
    """A training loop inside ``torch.autocast("cpu", float16)`` with ``Sifter(autocast=bf16)``:
    torch's cast cache is keyed by the weight and cleared only when the outermost autocast exits,
    so the step's next forward got the scoring forward's bf16 casts ("mat1 and mat2 must have the
    same dtype"; found by review, 2026-12-06). The stage's autocast caches nothing."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    samples = [{"__key__": f"k{i}", "x": x[i], "y": y[i]} for i in range(64)]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sifter = sp.Sifter(
        model, sp.CrossEntropy("x", "y"), sp.TopFraction(1.0), micro_batch=8, output_batch=8,
        autocast=torch.bfloat16,
    )  # fmt: skip
    steps = 0
    with torch.autocast("cpu", dtype=torch.float16):
        for batch in sifter(samples):
            out = model(batch["x"])
            assert out.dtype == torch.float16
            loss = torch.nn.functional.cross_entropy(out.float(), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
    assert steps == 8
