import pytest
import torch
import torch.nn.functional as F

import siftpipe as sp


def test_cross_entropy_by_field_and_by_position():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 4)
    x, y = torch.randn(8, 5), torch.randint(0, 4, (8,))
    expected = F.cross_entropy(model(x), y, reduction="none")
    torch.testing.assert_close(
        sp.get_scorer("cross_entropy", input="x", target="y")(model, {"x": x, "y": y}), expected
    )
    torch.testing.assert_close(sp.CrossEntropy()(model, (x, y)), expected)
    with pytest.raises(KeyError, match=r"no field 'image' \(it has 'x', 'y'\)"):
        sp.CrossEntropy("image", "y")(model, {"x": x, "y": y})


def test_cross_entropy_per_position_is_each_samples_mean_over_its_labelled_positions():
    """A segmentation model's [n, C, H, W] logits: a shape error before (found by review,
    2026-12-05), whose fix named a reduction a user of the built-in scorer cannot set."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 1)
    x, y = torch.randn(2, 3, 5, 5), torch.randint(0, 4, (2, 5, 5))
    y[1, :2] = -100  # unlabelled pixels
    per_pixel = F.cross_entropy(model(x), y, reduction="none")
    expected = torch.stack([per_pixel[0].mean(), per_pixel[1][2:].mean()])
    torch.testing.assert_close(sp.CrossEntropy()(model, (x, y)), expected)
    soft = torch.softmax(torch.randn(2, 4, 5, 5), dim=1)
    torch.testing.assert_close(
        sp.CrossEntropy()(model, (x, soft)),
        F.cross_entropy(model(x), soft, reduction="none").mean(dim=(1, 2)),
    )
    data = [{"x": x[i], "y": y[i], "__key__": i} for i in range(2)]
    assert (
        len(list(sp.Sifter(model, sp.CrossEntropy("x", "y"), sp.TopFraction(0.5), micro_batch=2)(data))) == 1
    )


def test_mse_reduces_every_dimension_but_the_first():
    model = torch.nn.Identity()
    pred, target = torch.ones(3, 2, 2), torch.zeros(3, 2, 2)
    pred[1] = 3.0
    assert sp.MeanSquaredError()(model, (pred, target)).tolist() == [1.0, 9.0, 1.0]


def test_cross_entropy_over_logits_with_the_classes_last_names_the_fix():
    """[n, T, C] logits with [n, T] labels: torch's "Expected target size [4, 7], got [4, 6]",
    naming no field and no fix (found by review, 2026-12-05)."""
    logits = torch.randn(4, 6, 7)
    scorer = sp.CrossEntropy(0, 1)
    with pytest.raises(sp.ScorerOutputError, match=r"\[4, 6, 7\].*TokenCrossEntropy.*transpose\(1, -1\)"):
        scorer(lambda x: x, (logits, torch.zeros(4, 6, dtype=torch.long)))
    fixed = sp.CrossEntropy(0, 1, forward=lambda m, x: m(x).transpose(1, -1))
    labels = torch.randint(7, (4, 6))
    want = F.cross_entropy(logits.transpose(1, -1), labels, reduction="none").mean(1)
    assert torch.allclose(fixed(lambda x: x, (logits, labels)), want)


def test_token_cross_entropy_ignores_padding_and_shifts():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, ids):
            return type("Out", (), {"logits": self.emb(ids)})()

    torch.manual_seed(0)
    lm = LM()
    ids = torch.randint(0, 10, (2, 6))
    labels = ids.clone()
    labels[1, 3:] = -100
    got = sp.TokenCrossEntropy("ids", "labels")(lm, {"ids": ids, "labels": labels})
    logits = lm.emb(ids)
    row0 = F.cross_entropy(logits[0], labels[0])
    row1 = F.cross_entropy(logits[1, :3], labels[1, :3])
    torch.testing.assert_close(got, torch.stack([row0, row1]))
    shifted = sp.TokenCrossEntropy("ids", "ids", shift=True)(lm, {"ids": ids})
    torch.testing.assert_close(shifted[0], F.cross_entropy(logits[0, :-1], ids[0, 1:]))
    all_ignored = sp.TokenCrossEntropy("ids", "labels")(
        lm, {"ids": ids, "labels": torch.full_like(ids, -100)}
    )
    assert all_ignored.tolist() == [0.0, 0.0]


def test_reducible_loss_subtracts_the_reference():
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    got = sp.ReducibleLoss(reference, "cross_entropy")(model, (x, y))
    expected = F.cross_entropy(model(x), y, reduction="none") - F.cross_entropy(
        reference(x), y, reduction="none"
    )
    torch.testing.assert_close(got, expected)
    assert sp.get_scorer("reducible", reference=reference).base.__class__ is sp.CrossEntropy
    with pytest.raises(sp.ConfigError, match="nn.Module"):
        sp.ReducibleLoss(reference=None)


def test_register_scorer_factory_and_duplicates():
    @sp.register_scorer("test_constant")
    class Constant:
        def __init__(self, value=1.0):
            self.value = value

        def __call__(self, model, batch):
            return torch.full((len(batch),), self.value)

    assert sp.get_scorer("test_constant", value=2.0)(None, [0, 0]).tolist() == [2.0, 2.0]
    assert "test_constant" in sp.scorer_names()
    with pytest.raises(sp.RegistryError, match="already registered.*overwrite=True"):
        sp.register_scorer("test_constant")(lambda: None)
    sp.register_scorer("test_constant", overwrite=True)(Constant)
    with pytest.raises(sp.RegistryError, match="non-empty string"):
        sp.register_scorer("")


def test_scoring_with_named_builtin_through_the_stage():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    data = [{"__key__": str(i), "input": torch.randn(4), "target": i % 3} for i in range(20)]
    s = sp.Sifter(
        model,
        sp.get_scorer("cross_entropy", input="input", target="target"),
        sp.TopFraction(0.5),
        micro_batch=10,
    )
    kept = list(s(data))
    assert len(kept) == 10
    with torch.no_grad():
        losses = F.cross_entropy(
            model(torch.stack([d["input"] for d in data])),
            torch.tensor([d["target"] for d in data]),
            reduction="none",
        )
    top = set()
    for start in (0, 10):
        top |= {str(i + start) for i in losses[start : start + 10].argsort(descending=True)[:5].tolist()}
    assert {k["__key__"] for k in kept} == top
