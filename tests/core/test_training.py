"""A tiny model trained through the stage reaches its target with fewer backward samples."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

import siftpipe as sp


def make_data(n, seed):
    # most points lie far from the curved boundary (easy); the ones near it teach the model
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 4 - 2
    y = (x[:, 1] > torch.sin(2 * x[:, 0])).long()
    return x, y


X_TRAIN, Y_TRAIN = make_data(20_000, 0)
X_TEST, Y_TEST = make_data(4_000, 1)
TARGET = 0.985


def accuracy(model):
    with torch.no_grad():
        return (model(X_TEST).argmax(1) == Y_TEST).float().mean().item()


def backward_samples_to_target(policy):
    """Backward samples until test accuracy reaches TARGET (checked every 20 steps of 32)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 2),
    )
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    samples = list(zip(X_TRAIN, Y_TRAIN))
    sifter = (
        sp.Sifter(model, "cross_entropy", policy, micro_batch=128, output_batch=32, key=None, delay=1000)
        if policy is not None
        else None
    )
    backward, steps = 0, 0
    for _ in range(10):
        if sifter is not None:
            stream = sifter(samples)
        else:
            stream = (default_collate(samples[i : i + 32]) for i in range(0, len(samples), 32))
        for x, y in stream:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            backward += len(y)
            steps += 1
            if steps % 20 == 0 and accuracy(model) >= TARGET:
                return backward
    pytest.fail(f"{policy} never reached {TARGET}")


def test_sifting_reaches_the_target_with_fewer_backward_samples():
    full = backward_samples_to_target(None)
    sifted = backward_samples_to_target(sp.RelativeProbabilistic(beta=3.0, history=1000))
    top = backward_samples_to_target(sp.TopFraction(0.25))
    assert sifted < 0.75 * full, (sifted, full)
    assert top < 0.9 * full, (top, full)
