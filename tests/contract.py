"""One save/load-state contract that every way of running the stage must pass.

Like torchdata's ``run_test_save_load_state``: run uninterrupted; then, for each cut point, run
to the cut, checkpoint (through torch.save / torch.load(weights_only=True)), build a new
pipeline, restore, and finish. The outputs must match the uninterrupted run exactly, and the
kept samples must be a subset of the input, in input order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torchdata.nodes import Loader

from tests.common import roundtrip


def signature(item: Any) -> Any:
    """A comparable picture of an output item (sample or batch), without where it was read from
    (``__url__``, ``__local_path__``: the same samples come from local and remote shards)."""
    if isinstance(item, dict):
        return tuple(
            sorted((k, signature(v)) for k, v in item.items() if k not in ("__url__", "__local_path__"))
        )
    if isinstance(item, tuple | list):
        return tuple(signature(v) for v in item)
    if isinstance(item, torch.Tensor):
        return ("tensor", tuple(item.shape), tuple(item.flatten().tolist()))
    return item


def output_keys(outputs: Iterable[Any]) -> list[str]:
    """Sample keys of per-sample or batched outputs, flattened in order."""
    keys: list[str] = []
    for item in outputs:
        k = item["__key__"]
        keys.extend(k if isinstance(k, list) else [k])
    return keys


class Adapter:
    """How to build a pipeline around the stage, iterate it, checkpoint it and resume it."""

    def start(self) -> Iterator[Any]:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def resume(self, state: dict[str, Any]) -> Iterator[Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what an abandoned run holds (worker processes); called after the checkpoint."""


class PlainList(Adapter):
    """The stage over a plain list, resumed by feeding the list from ``state['consumed']``
    (what the README tells a user with a plain iterable to do)."""

    def __init__(self, data: list[Any], sifter: Any = None, **kwargs: Any) -> None:
        import siftpipe as sp

        self.data = data
        self.sifter = sifter if sifter is not None else sp.Sifter(**kwargs)

    def start(self) -> Iterator[Any]:
        return self.sifter(self.data)

    def state(self) -> dict[str, Any]:
        return self.sifter.state_dict()

    def resume(self, state: dict[str, Any]) -> Iterator[Any]:
        self.sifter.load_state_dict(state)
        return self.sifter(self.data[state["consumed"] :])


class OneEpochLoader(Adapter):
    """A torchdata node under a ``Loader`` for one epoch: a Loader that restarts would answer a
    checkpoint taken after the epoch's last item with the next epoch (torchdata's rule, tested in
    tests/adapters/test_nodes.py)."""

    def __init__(self, node: Any) -> None:
        self.loader = Loader(node, restart_on_stop_iteration=False)

    def start(self) -> Iterator[Any]:
        return iter(self.loader)

    def state(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def resume(self, state: dict[str, Any]) -> Iterator[Any]:
        self.loader.load_state_dict(state)
        return iter(self.loader)


def check_save_load(make: Callable[[], Adapter], cuts: Iterable[int], input_keys: list[str] | None = None):
    reference = list(make().start())
    ref_sig = [signature(x) for x in reference]
    assert reference, "the pipeline produced nothing: a contract run on nothing proves nothing"
    if input_keys is not None:
        kept = output_keys(reference)
        pos = {k: i for i, k in enumerate(input_keys)}
        order = [pos[k] for k in kept]
        assert order == sorted(order), "kept samples are not in input order"
        assert len(set(kept)) == len(kept), "a sample was handed on twice"
    for cut in cuts:
        if cut > len(reference):
            continue
        first = make()
        it = first.start()
        head = [next(it) for _ in range(cut)]
        state = roundtrip(first.state())
        first.close()
        second = make()
        tail = list(second.resume(state))
        got = [signature(x) for x in head + tail]
        assert len(got) == len(ref_sig), f"cut {cut}: {len(got)} outputs, uninterrupted gave {len(ref_sig)}"
        assert got == ref_sig, f"cut {cut}: resumed outputs differ from the uninterrupted run"
    return reference


def run_save_load_state(make_root, midpoint):
    """torchdata's save/load-state contract for a node, written again from its description.

    One Loader over the node: take ``midpoint`` items and checkpoint, finish epoch 0 and
    checkpoint, run epoch 1. Then restoring the mid-epoch checkpoint must give the rest of
    epoch 0 and then the same epoch 1; restoring the checkpoint taken before anything was read
    must give epochs 0 and 1 again; restoring the end-of-epoch checkpoint gives nothing when the
    loader does not restart, and epoch 1 when it does. Items are compared by value.
    """
    root = make_root()
    loader = Loader(root)
    initial = roundtrip(loader.state_dict())
    it = iter(loader)
    epoch0 = [next(it) for _ in range(midpoint)]
    middle = roundtrip(loader.state_dict())
    epoch0 += list(it)
    end = roundtrip(loader.state_dict())
    epoch1 = list(loader)
    sig0, sig1 = [signature(x) for x in epoch0], [signature(x) for x in epoch1]
    assert midpoint < len(epoch0), "the midpoint must fall inside the epoch"

    loader.load_state_dict(middle)
    assert [signature(x) for x in loader] == sig0[midpoint:]
    assert [signature(x) for x in loader] == sig1

    loader.load_state_dict(initial)
    assert [signature(x) for x in loader] == sig0
    assert [signature(x) for x in loader] == sig1

    no_restart = Loader(root, restart_on_stop_iteration=False)
    no_restart.load_state_dict(end)
    assert list(no_restart) == []

    restart = Loader(root)
    restart.load_state_dict(end)
    assert [signature(x) for x in restart] == sig1
    return epoch0, epoch1
