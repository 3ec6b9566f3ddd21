import math

import pytest
import torch

import siftpipe as sp
from tests.common import loss_field, make_samples

SAMPLES = make_samples(100)


@pytest.mark.parametrize(
    "scorer,match",
    [
        (lambda m, b: b["loss"].double().unsqueeze(1), r"shape \[64, 1\].*expected \[64\].*reduction='none'"),
        (lambda m, b: b["loss"][:10].double(), r"shape \[10\].*expected \[64\].*one loss per sample"),
        (lambda m, b: b["loss"].double().sum(), r"shape \[\].*expected \[64\]"),
        (lambda m, b: b["loss"].long(), r"dtype torch.int64.*floating point"),
        (lambda m, b: b["loss"].tolist(), r"returned a list.*torch.Tensor of shape \[64\]"),
        # found 2026-12-05 (fourth session): numpy's TypeError, and torch's "Internal error"
        (lambda m, b: b["loss"].double().to_sparse(), r"returned a sparse_coo tensor.*loss.to_dense\(\)"),
        (
            lambda m, b: torch.nested.nested_tensor(
                [t.double().reshape(1) for t in b["loss"]], layout=torch.jagged
            ),
            r"returned a nested tensor.*torch.stack",
        ),
    ],
)
def test_wrong_scorer_output_names_the_problem_and_the_fix(scorer, match):
    with pytest.raises(sp.ScorerOutputError, match=match):
        list(sp.Sifter(None, scorer, micro_batch=64)(SAMPLES))


def test_scorer_exception_names_the_micro_batch_and_keys():
    def scorer(model, batch):
        raise ValueError("bad input")

    with pytest.raises(
        sp.ScorerError, match=r"ValueError: bad input.*64 samples at seq 0.*'s000000', 's000001'"
    ):
        list(sp.Sifter(None, scorer, micro_batch=64)(SAMPLES))


def with_losses(values):
    data = make_samples(len(values))
    for d, v in zip(data, values):
        d["loss"] = v
    return data


def test_nan_raises_by_default_naming_the_sample():
    data = with_losses([1.0, 2.0, math.nan, 3.0])
    with pytest.raises(sp.NonFiniteLossError, match=r"seq 2, keys \['s000002'\].*on_nan='keep' or 'drop'"):
        list(sp.Sifter(None, loss_field, micro_batch=4)(data))


@pytest.mark.parametrize("on_nan,kept", [("keep", True), ("drop", False)])
def test_nan_keep_or_drop_is_counted_and_kept_out_of_history(on_nan, kept):
    data = with_losses([1.0, math.nan, 2.0, math.inf, 3.0, -math.inf])
    policy = sp.RelativeProbabilistic(1.0, 100)
    s = sp.Sifter(None, loss_field, policy, micro_batch=3, on_nan=on_nan)
    out = [o["__key__"] for o in s(data)]
    assert s.stats.nan == 3
    assert ("s000001" in out) is kept and ("s000003" in out) is kept
    assert sorted(policy.history.values().tolist()) == [1.0, 2.0, 3.0]


def test_unknown_names_list_what_is_registered():
    with pytest.raises(
        sp.RegistryError, match=r"unknown scorer 'crossentropy'.*cross_entropy.*register_scorer"
    ):
        sp.Sifter(None, "crossentropy")
    with pytest.raises(sp.RegistryError, match=r"unknown policy 'topk'.*top_fraction"):
        sp.Sifter(None, loss_field, "topk")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"micro_batch": 0}, "micro_batch must be a number of samples >= 1"),
        ({"micro_batch": None}, "needs batched=True"),
        ({"delay": -1}, "delay must be"),
        ({"output_batch": 0}, "output_batch must be"),
        ({"on_nan": "ignore"}, "on_nan must be"),
        ({"policy": object()}, "policy must be a siftpipe.Policy"),
    ],
)
def test_bad_stage_parameters(kwargs, match):
    with pytest.raises(sp.ConfigError, match=match):
        sp.Sifter(None, loss_field, **kwargs)


def test_every_error_is_a_sift_error():
    for cls in (
        sp.ConfigError,
        sp.RegistryError,
        sp.ScorerError,
        sp.ScorerOutputError,
        sp.NonFiniteLossError,
        sp.MissingKeyError,
        sp.ResumeError,
        sp.SiftInWorkerError,
        sp.AuditError,
        sp.ShardError,
    ):
        assert issubclass(cls, sp.SiftError)


def test_collate_failure_names_the_fix():
    data = [{"__key__": "a", "x": torch.zeros(2)}, {"__key__": "b", "x": torch.zeros(3)}]
    with pytest.raises(sp.ScorerError, match=r"collating micro-batch.*'a', 'b'.*collate_fn"):
        list(sp.Sifter(None, loss_field, micro_batch=2)(data))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: sp.Sifter(None, loss_field, seed=-1), r"seed must be an integer >= 0.*-1"),
        (lambda: sp.Sifter(None, loss_field, seed=1.5), r"seed must be an integer >= 0.*1\.5"),
        (lambda: sp.Sifter(None, loss_field, seed="0"), r"seed must be an integer >= 0.*'0'"),
        (lambda: sp.Sifter(None, loss_field, seed=True), r"seed must be an integer >= 0"),
        (
            lambda: sp.Sifter(None, loss_field, device="gpu0"),
            r"device='gpu0' is not a torch device.*'cuda:1'",
        ),
        (
            lambda: sp.RelativeProbabilistic(history=10**13),
            r"loss history of 10,000,000,000,000 losses.*GiB.*typical",
        ),
        (lambda: sp.PruneEasy(history=10**13), r"loss history of 10,000,000,000,000 losses"),
        (lambda: sp.ScoreMemory(10**13), r"score memory of capacity 10,000,000,000,000.*one epoch"),
    ],
)
def test_a_bad_setting_is_a_config_error_with_the_fix(make, match):
    with pytest.raises(sp.ConfigError, match=match):
        make()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_a_config_error():
    with pytest.raises(sp.ConfigError, match="sees no CUDA device"):
        sp.Sifter(None, loss_field, device="cuda:0")


def test_a_model_on_the_meta_device_is_a_config_error_naming_the_fix():
    model = torch.nn.Linear(4, 3, device="meta")
    s = sp.Sifter(model, sp.CrossEntropy("x", "y"), micro_batch=8)
    with pytest.raises(sp.ConfigError, match=r"meta device.*to_empty"):
        s(SAMPLES)
    model.to_empty(device="cpu")  # materialised later: the same stage then scores
    model.reset_parameters()  # (to_empty leaves whatever was in memory: a NaN or inf loss at times)
    assert len(list(s(SAMPLES))) > 0


@pytest.mark.parametrize("key", ["abc", "shard-0001", torch.tensor(7)], ids=["str_3", "str_10", "0d_tensor"])
@pytest.mark.parametrize("what", ["memory", "audit"])
def test_a_batch_keyed_by_one_value_for_all_its_rows_is_refused_naming_the_field(tmp_path, key, what):
    """A collated batch whose key field is one string or a 0-d tensor: a string of as many
    characters as rows was read as a key per character (the log said a, b, c), a longer one
    raised a bare IndexError or an AuditError blaming storage at close, a 0-d tensor "int has
    no len()" (found by review, 2026-12-05)."""
    extra = (
        {"memory": sp.ScoreMemory(100)} if what == "memory" else {"audit": sp.AuditLog(str(tmp_path / "log"))}
    )
    s = sp.Sifter(None, lambda m, b: b["loss"], sp.Uniform(1.0), batched=True, micro_batch=None, **extra)
    batch = {"__key__": key, "loss": torch.tensor([0.5, 1.0, 1.5])}
    with pytest.raises(sp.MissingKeyError, match=r"one value for the whole batch in its key field '__key__'"):
        list(s([batch]))
    s.close()
    good = sp.Sifter(
        None,
        lambda m, b: b["loss"],
        sp.Uniform(1.0),
        batched=True,
        micro_batch=None,
        key=lambda b: ["a", "b"],
        audit=sp.AuditLog(str(tmp_path / "log2")),
    )
    with pytest.raises(
        sp.MissingKeyError, match=r"has 2 keys in its key field \(key=<lambda>\) for its 3 rows"
    ):
        list(good([{"loss": torch.tensor([0.5, 1.0, 1.5])}]))
