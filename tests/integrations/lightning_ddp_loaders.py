"""Run under torchrun (two gloo processes) by tests/integrations/test_lightning.py: the DataLoaders a
sifted Lightning DDP run is given, and what each rank reads from them. Prints one JSON line (rank 0).

Each case is one ``trainer.fit`` of one epoch with a stage that keeps every sample (it decides
nothing during its ``delay``), so the keys trained are the keys each rank read.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

import siftpipe as sp
from siftpipe.integrations.lightning import SiftCallback

warnings.filterwarnings("ignore")
N = 240


class Points(Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(N, 8, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": int(i % 3)}


class Evens(Sampler[int]):
    """A sampler of one's own: the even indices, in order."""

    def __iter__(self):
        return iter(range(0, N, 2))

    def __len__(self) -> int:
        return N // 2


class MyBatches(Sampler[list[int]]):
    """A batch sampler that is not a torch BatchSampler."""

    def __iter__(self):
        return (list(range(i, i + 12)) for i in range(0, N, 12))

    def __len__(self) -> int:
        return N // 12


class Net(L.LightningModule):
    def __init__(self, sift: SiftCallback, loader: DataLoader) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 3)
        self.sift, self.loader = sift, loader
        self.trained: list[int] = []

    def forward(self, x):
        return self.net(x)

    def train_dataloader(self):
        return self.sift.loader(self.loader)

    def training_step(self, batch, batch_idx):
        self.trained += [int(k) for k in batch["__key__"]]
        return self.sift.loss(F.cross_entropy(self(batch["x"]), batch["y"], reduction="none"), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def ddp_trainer(**settings) -> L.Trainer:
    """A quiet Lightning Trainer on two gloo processes (CPU, DDP), with ``settings`` on top (also
    used by tests/integrations/lightning_ddp_resume.py)."""
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    return L.Trainer(accelerator="cpu", devices=2, strategy="ddp", **{**quiet, **settings})


def fit(model: Net, epochs: int = 1, use_distributed_sampler: bool = True) -> None:
    """``trainer.fit`` on two gloo processes with the model's sifting callback."""
    trainer = ddp_trainer(
        max_epochs=epochs,
        enable_checkpointing=False,
        callbacks=[model.sift],
        use_distributed_sampler=use_distributed_sampler,
    )
    trainer.fit(model)


def run(loader: DataLoader, use_distributed_sampler: bool = True) -> list[list[int]]:
    """The keys each rank trained (every rank's list)."""
    sift = SiftCallback(lambda: sp.Sifter(None, sp.CrossEntropy("x", "y"), delay=10_000, output_batch=12))
    model = Net(sift, loader)
    fit(model, use_distributed_sampler=use_distributed_sampler)
    ranks: list[list[int]] = [[], []]
    dist.all_gather_object(ranks, model.trained)
    return ranks


def run_memory(loader: DataLoader) -> dict[str, list[int]]:
    """Two epochs with the recipe's score memory: how many keys each rank's memory holds at the
    end, and how many samples each kept unknown (no loss known) in the second epoch."""
    sifters: list[sp.Sifter] = []

    def make() -> sp.Sifter:
        sifter = sp.recipe(None, sp.CrossEntropy("x", "y"), budget=2 * N, output_batch=12, cost_guard=False)
        sifters.append(sifter)
        return sifter

    fit(Net(SiftCallback(make), loader), epochs=2)
    sifter = sifters[-1]
    mine = [len(sifter.memory), sifter.stats.unknown]
    ranks: list[list[int]] = [[], []]
    dist.all_gather_object(ranks, mine)
    return {"held": [r[0] for r in ranks], "unknown": [r[1] for r in ranks]}


def main() -> None:
    data = Points()
    out = {
        "custom_sampler": run(DataLoader(data, batch_size=12, sampler=Evens())),
        "custom_sampler_no_sharding": run(
            DataLoader(data, batch_size=12, sampler=Evens()), use_distributed_sampler=False
        ),
        "batch_sampler": run(DataLoader(data, batch_sampler=BatchSampler(Evens(), 12, drop_last=False))),
    }
    # the user's own DistributedSampler deals samples anew each epoch: the memory is shared
    rank = int(os.environ["RANK"])
    dealt = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
    out["memory_own_distributed_sampler"] = run_memory(DataLoader(data, batch_size=12, sampler=dealt))
    # a plain shuffled loader: the callback installs RankShareSampler, and nothing is shared
    out["memory_rank_share"] = run_memory(DataLoader(data, batch_size=12, shuffle=True))
    try:
        run(DataLoader(data, batch_sampler=MyBatches()))
        out["custom_batch_sampler"] = "no error"
    except sp.ConfigError as exc:
        out["custom_batch_sampler"] = str(exc)
    if dist.get_rank() == 0:
        print(json.dumps(out))
    sys.stdout.flush()
    # Lightning leaves the process group up: destroyed here, its gloo threads are joined before
    # the interpreter exits (left to exit, a rank once aborted: "terminate called without an
    # active exception", exit -6, on the loaded 2-core CI machine)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
