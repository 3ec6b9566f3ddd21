"""Sift a small CNN in PyTorch Lightning with InfoBatch's rule and its weights: generated images, CPU.

    python examples/lightning_vision.py                    # well under a minute on 2 cores
    python examples/lightning_vision.py --devices 2        # DDP on 2 CPU processes (gloo)

The data: 16x16 images of a bar, horizontal, vertical or diagonal (the class), drawn clearly (90%)
or faintly in heavy noise (10%, the hard tail). ``sp.PruneEasy`` drops half of the samples whose
loss is below the running mean and gives the easy ones it keeps weight 2, so the expected gradient
is the full data's; ``sift.loss`` applies the weights to the loss Lightning optimises. Pruning
stops for the last epoch (``anneal``), as InfoBatch does. The lines marked ``# sifting`` are all
that sifting adds.

Rank 0 prints one JSON line: samples seen and kept, the share of kept samples that carried a
weight above 1, and the test accuracy on clear and on faint images.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import siftpipe as sp  # sifting
from siftpipe.integrations.lightning import SiftCallback  # sifting

SIZE = 16


class Bars(Dataset):
    """Images of a bar in one of three orientations; every tenth is faint and noisy."""

    def __init__(self, n: int, seed: int, faint_only: bool = False, clear_only: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(3, (n,), generator=g)
        faint = torch.zeros(n, dtype=torch.bool)
        if faint_only:
            faint[:] = True
        elif not clear_only:
            faint[::10] = True
        offset = torch.randint(2, SIZE - 2, (n,), generator=g)
        rows = torch.arange(SIZE).view(SIZE, 1).expand(SIZE, SIZE)
        cols = rows.t()
        images = torch.empty(n, 1, SIZE, SIZE)
        for i in range(n):
            o, c = int(offset[i]), int(self.labels[i])
            bar = (rows == o) if c == 0 else (cols == o) if c == 1 else ((rows - cols) == o - SIZE // 2)
            strength, noise = (0.5, 0.6) if faint[i] else (1.0, 0.2)
            images[i, 0] = strength * bar.float() + noise * torch.randn(SIZE, SIZE, generator=g)
        self.images = images
        self.faint = faint

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": self.labels[index]}


class Classifier(L.LightningModule):
    def __init__(self, sift: SiftCallback, train: Bars, batch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 3),
        )
        self.sift = sift
        self.train_data = train
        self.batch = batch
        self.weighted = self.trained = 0  # measured for the summary, not needed to sift

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)

    def train_dataloader(self) -> object:
        loader = DataLoader(self.train_data, batch_size=self.batch, shuffle=True)
        return self.sift.loader(loader)  # sifting

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.trained += len(batch["label"])
        self.weighted += int((batch["__sift_weight__"] > 1).sum())
        per_sample = F.cross_entropy(self(batch["image"]), batch["label"], reduction="none")
        return self.sift.loss(per_sample, batch)  # sifting: the weights are applied here

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def accuracy(model: nn.Module, data: Bars) -> float:
    with torch.inference_mode():
        return float((model(data.images).argmax(1) == data.labels).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=6000, help="training images to generate")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="kept images per batch and process")
    ap.add_argument("--ratio", type=float, default=0.5, help="PruneEasy: share of easy samples dropped")
    ap.add_argument("--devices", type=int, default=1, help="CPU processes (2 or more: DDP over gloo)")
    ap.add_argument("--sync-every", type=int, default=0, help="DDP: steps between loss-history syncs")
    ap.add_argument("--output", default=None, help="checkpoints (default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="lightning")
    torch.set_num_threads(1)
    started = time.perf_counter()
    output = args.output or tempfile.mkdtemp(prefix="siftpipe-lightning-vision-")

    L.seed_everything(args.seed, verbose=False)
    train = Bars(args.samples, seed=args.seed)
    per_rank = args.samples // args.devices
    sift = SiftCallback(  # sifting: the stage is built on each process when training starts
        scorer=sp.CrossEntropy("image", "label"),
        policy=sp.PruneEasy(args.ratio, anneal=per_rank * (args.epochs - 1), history=1000),
        micro_batch=256,
        seed=args.seed,
        sync_every=args.sync_every or None,  # DDP: the mean loss over all ranks
    )
    model = Classifier(sift, train, args.batch)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=[sift, L.callbacks.ModelCheckpoint(dirpath=output, save_last=True)],  # sifting: `sift`
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)

    stats = sift.sifter.stats
    mine = {"seen": stats.seen, "kept": stats.kept, "trained": model.trained, "weighted": model.weighted}
    ranks = [mine]
    if dist.is_available() and dist.is_initialized():
        ranks = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(ranks, mine)
        dist.destroy_process_group()  # Lightning leaves it up: its threads end before the interpreter
    model.eval()
    clear = accuracy(model, Bars(600, seed=10_001, clear_only=True))
    faint = accuracy(model, Bars(600, seed=10_002, faint_only=True))
    if trainer.global_rank != 0:
        return
    trained = sum(r["trained"] for r in ranks)
    print(
        json.dumps(
            {
                "world_size": trainer.world_size,
                "epochs": trainer.current_epoch,
                "steps": trainer.global_step,
                "ranks": ranks,
                "seen": sum(r["seen"] for r in ranks),
                "kept": sum(r["kept"] for r in ranks),
                "weighted_share_of_trained": sum(r["weighted"] for r in ranks) / max(1, trained),
                "accuracy_clear": clear,
                "accuracy_faint": faint,
                "seconds": round(time.perf_counter() - started, 1),
                "output": output,
            }
        )
    )


if __name__ == "__main__":
    main()
