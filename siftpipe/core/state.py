"""The stage's checkpoint: its entries and counters by name, their validation before anything
loads, digests of each entry, and the settings a resume may override on purpose."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, ResumeError
from .account import CostAccount
from .memory import check_memory_state
from .policies import HistoryPolicy, Policy
from .values import is_int, short_repr

#: The version of the state dicts ``Sifter.state_dict()`` writes.
STATE_VERSION = 2

# settings a resumed stage may differ in on purpose (see Sifter.load_state_dict), and the state
# entries each covers beyond its own name
RESUME_OVERRIDES = (
    "delay",
    "key",
    "memory",
    "micro_batch",
    "on_nan",
    "output_batch",
    "policy",
    "rank",
    "seed",
    "unknown",
)
OVERRIDE_OF = {"policy_class": "policy", "policy_config": "policy", "world": "rank"}
READ_VERSIONS = (1, 2)  # state versions load_state_dict reads
# entries that hold wall time: not digested (nothing to check them against); "account" is optional
# (states written before the cost account lack it)
WALL_CLOCK = ("seconds", "account", "run_began")


COUNTS = (
    "seen",
    "kept",
    "dropped",
    "nan",
    "warmup",
    "micro_batches",
    "scored",
    "from_memory",
    "observed",
    "unknown",
    "stopped_at",
    "unhanded",
)
# counters a state may lack (written before they existed): they load as 0
LATER_COUNTS = ("unknown", "stopped_at", "unhanded")
# the settings a version 2 state's config names (see Sifter._config)
CONFIG = (
    "micro_batch",
    "batched",
    "output_batch",
    "delay",
    "policy",
    "policy_class",
    "policy_config",
    "on_nan",
    "seed",
    "key",
    "memory",
    "rank",
    "world",
)
# entries version 2 added (version 1 states load with their defaults)
ENTRIES_2 = (
    "epoch_set",
    "opened",
    "pass_read",
    "read",
    "next_key",
    "ended",
    "source_abandoned",
    "checks",
)
ENTRIES = (
    "version",
    "config",
    "policy",
    "rng",
    "counts",
    "seconds",
    "consumed",
    "pending",
    "emitted",
    "epoch",
    "pass_open",
    "model_version",
    "source",
    "audit",
    "memory",
)


def check_state(state: Any, batched: bool) -> None:
    """Raise ``ResumeError`` naming the first missing or malformed entry of a Sifter state, before
    anything is loaded from it."""
    if not isinstance(state, Mapping) or "version" not in state:
        hint = ""
        if isinstance(state, Mapping) and any(str(k).startswith("_") for k in state):
            hint = " (it looks like a loader's or a torchdata node's state: load it with that object)"
        raise ResumeError(f"not a siftpipe Sifter state dict (no 'version' entry){hint}")
    if type(state["version"]) is not int or state["version"] not in READ_VERSIONS:
        raise ResumeError(
            f"state dict version {state['version']!r} is not supported (this siftpipe writes version "
            f"{STATE_VERSION} and reads {list(READ_VERSIONS)})"
        )
    if "sifter" in state and "config" not in state:
        raise ResumeError(
            "this is a SiftNode's state (a 'sifter' entry inside): restore it with the node's or the "
            "Loader's load_state_dict, or pass state['sifter'] to Sifter.load_state_dict"
        )
    missing = [
        name for name in (*ENTRIES, *(ENTRIES_2 if state["version"] >= 2 else ())) if name not in state
    ]
    if missing:
        raise ResumeError(
            f"the Sifter state lacks {missing} (a truncated or partial state?); pass the whole dict "
            "that Sifter.state_dict() returned"
        )

    def bad(entry: str, want: str) -> ResumeError:
        value: Any = state
        for part in entry.replace("]", "").split("["):
            try:
                value = value[int(part) if part.isdigit() else part.strip("'")]
            except (KeyError, IndexError, TypeError):
                value = None
                break
        return ResumeError(
            f"the Sifter state's entry {entry} must be {want}, got {type(value).__name__} "
            f"{short_repr(value)}; the state is damaged, or not one Sifter.state_dict() wrote"
        )

    for name in ("config", "policy", "counts", "rng"):
        if not isinstance(state[name], Mapping):
            raise bad(name, "a dict")
    scratch = np.random.default_rng()
    try:
        scratch.bit_generator.state = state["rng"]
        # numpy coerces what it can (a float, a bool): a damaged state does not read back the same
        reads_back = scratch.bit_generator.state == dict(state["rng"])
    except Exception as exc:
        raise ResumeError(
            f"the Sifter state's entry rng is not a numpy generator state ({type(exc).__name__}: {exc}); "
            "the state is damaged, or not one Sifter.state_dict() wrote"
        ) from None
    rng = state["rng"]
    if (
        not reads_back
        or not plain_ints(rng)
        or rng.get("has_uint32", 0) not in (0, 1)
        or not 0 <= rng.get("uinteger", 0) < 2**32
    ):
        raise bad("rng", "the generator state numpy wrote (it does not read back the same)")
    # the checkpoint's own mode (a stage in the other mode is refused by name afterwards)
    batched = bool(state["config"].get("batched", batched))
    counts = state["counts"]
    # version 1 states written before some counters existed lack them
    for name in (
        (c for c in COUNTS if c not in LATER_COUNTS) if state["version"] >= 2 else ("seen", "kept", "dropped")
    ):
        if name not in counts:
            raise bad(f"counts[{name!r}]", "a count >= 0")
    for name, value in counts.items():
        if name not in COUNTS:
            raise bad(f"counts[{name!r}]", f"one of the counters {list(COUNTS)}")
        if not is_int(value):
            raise bad(f"counts[{name!r}]", "a count >= 0")
    seen = int(counts["seen"])
    if counts["kept"] + counts["dropped"] != seen:
        raise bad("counts['seen']", f"kept + dropped ({counts['kept']} + {counts['dropped']})")
    for name in ("nan", "warmup", "scored", "from_memory", "unknown", "unhanded"):
        if counts.get(name, 0) > seen:
            raise bad(f"counts[{name!r}]", f"at most the {seen} samples seen")
    seconds = state["seconds"]
    if not (
        isinstance(seconds, list | tuple)
        and len(seconds) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in seconds)
    ):
        raise bad("seconds", "a list of 2 numbers of seconds >= 0")
    if "account" in state:
        check_account(state["account"], bad)
    if not (state["source"] is None or isinstance(state["source"], Mapping)):
        raise bad("source", "None or the tracked source's state dict")
    for name in ("consumed", "emitted", "epoch", *(n for n in ("read", "steps") if n in state)):
        if not is_int(state[name]):
            raise bad(name, "an integer >= 0")
    raised = state.get("raised", [])
    if not (
        isinstance(raised, list | tuple)
        and all(is_int(p) for p in raised)
        and all(a <= b for a, b in itertools.pairwise(raised))
    ):
        raise bad("raised", "an ascending list of input item counts >= 0")
    if not is_int(state["model_version"], -(2**63)):
        raise bad("model_version", "an integer")
    for name in ("pass_open", "epoch_set", "ended", "source_abandoned", "opened", "pass_read"):
        if name in state and not isinstance(state[name], bool):
            raise bad(name, "True or False")
    pending = state["pending"]
    if not isinstance(pending, list | tuple):
        raise bad("pending", "a list")
    if pending and not state["pass_open"]:
        raise bad("pending", "empty between passes (pass_open is False)")
    kept = 0
    seq = None  # where the next pending group must start: groups are decided one after another
    for i, desc in enumerate(pending):
        where = f"pending[{i}]"
        if not isinstance(desc, Mapping):
            raise bad(where, "a dict")
        for name in ("n_items", "rows", "seq0", "keep", "weight", "keys"):
            if name not in desc:
                raise bad(f"{where}[{name!r}]", "present")
        for name, low in (("n_items", 1), ("rows", 1), ("seq0", 0)):
            if not is_int(desc[name], low):
                raise bad(f"{where}[{name!r}]", f"an integer >= {low}")
        rows = int(desc["rows"])
        if seq is not None and desc["seq0"] != seq:
            raise bad(f"{where}['seq0']", f"{seq}, where the group before it ends")
        seq = int(desc["seq0"]) + rows
        if (batched and desc["n_items"] != 1) or (not batched and desc["n_items"] != rows):
            raise bad(f"{where}['n_items']", "1 input batch" if batched else "equal to rows")
        keep = desc["keep"]
        if not (isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and tuple(keep.shape) == (rows,)):
            raise bad(f"{where}['keep']", f"a bool tensor of {rows} rows")
        weight = desc["weight"]
        if weight is not None and not (
            isinstance(weight, torch.Tensor)
            and weight.is_floating_point()
            and tuple(weight.shape) == (rows,)
            and bool(torch.isfinite(weight).all())
        ):
            raise bad(f"{where}['weight']", f"None or a float tensor of {rows} finite weights")
        keys = desc["keys"]
        if keys is not None and not (isinstance(keys, list | tuple) and len(keys) == rows):
            raise bad(f"{where}['keys']", f"None or a list of {rows} sample keys")
        shards = desc.get("shards")  # (states written before 2026-12-04 lack it)
        if shards is not None and not (
            isinstance(shards, list | tuple)
            and len(shards) == rows
            and all(u is None or isinstance(u, str) for u in shards)
        ):
            raise bad(f"{where}['shards']", f"None or a list of {rows} shard file names (or None each)")
        kept += int(keep.sum())
    if seq is not None and seq != seen:
        raise bad("counts['seen']", f"{seq}, where the last pending group ends")
    # (all of them: a group whose read ended in a source error not handed on yet stays pending
    # once handed on, so that a resume meets the error: Ledger.error_held)
    if state["emitted"] > kept:
        raise bad("emitted", f"at most the {kept} kept rows pending")
    if "read" in state and state["read"] != state["consumed"] + sum(int(d["n_items"]) for d in pending):
        raise bad("read", "consumed plus the input items pending (a pending group went missing?)")
    config = state["config"]
    if state["version"] >= 2:
        lacking = [name for name in CONFIG if name not in config]
        if lacking:
            raise bad("config", f"the settings {list(CONFIG)} (it lacks {lacking})")
    if "memory" in config and (config["memory"] is None) != (state["memory"] is None):
        raise bad("memory", "present exactly when the state's config names a score memory")
    if isinstance(config.get("memory"), Mapping) and isinstance(state["memory"], Mapping):
        for name in ("capacity", "max_age"):
            if not same_value(config["memory"].get(name), state["memory"].get(name)):
                raise bad(
                    f"memory[{name!r}]", f"the {name} its config names ({config['memory'].get(name)!r})"
                )
    check_flags(state, bad)

    began = state.get("run_began")  # (wall time, not digested; states before 2026-12-05 lack it)
    if began is not None and not (
        isinstance(began, float | int) and not isinstance(began, bool) and np.isfinite(began) and began > 0
    ):
        raise bad("run_began", "None or the run's start, in seconds since the epoch (a number > 0)")
    if state["memory"] is not None and state["epoch"] > np.iinfo(np.int16).max:
        raise bad("epoch", "at most 32767 with a score memory (it records epochs in 16 bits)")
    if state["audit"] is not None and not isinstance(state["audit"], Mapping):
        # (the sink checks its own entry: DecisionSink.check_state)
        raise bad("audit", "None or a dict (the state of the stage's audit log or sink)")
    check_memory_state(state["memory"], bad)
    if "checks" in state:  # last: the checks above name what is wrong more exactly
        checks = state["checks"]
        entries = set(state) - {*WALL_CLOCK, "checks"}
        if not (isinstance(checks, Mapping) and set(checks) == entries):
            raise bad("checks", f"the digests of the entries {sorted(entries)}")
        for name in sorted(entries):
            if checks[name] != digest(state[name]):
                raise bad(name, "the value the checkpoint recorded a digest of (damaged, or swapped in?)")


def digest(tree: Any) -> str:
    """A digest of a state's entry: its structure, numbers, strings and tensors' bytes."""
    h = hashlib.blake2b(digest_size=16)

    def feed(x: Any) -> None:
        if isinstance(x, Mapping):
            h.update(b"{")
            for k in sorted(x, key=str):
                feed(str(k))
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, list | tuple):
            h.update(b"[")
            for v in x:
                feed(v)
            h.update(b"]")
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())

    feed(tree)
    return h.hexdigest()


def plain_ints(tree: Any) -> bool:
    """Every number in ``tree`` is an int (not a bool or a float)."""
    if isinstance(tree, Mapping):
        return all(plain_ints(v) for v in tree.values())
    return isinstance(tree, str) or (isinstance(tree, int) and not isinstance(tree, bool))


def check_flags(state: Mapping[str, Any], bad: Callable[[str, str], ResumeError]) -> None:
    """The position flags agree with each other (each is written from the same position)."""
    pending, open_ = state["pending"], state["pass_open"]
    if state.get("ended") and (pending or not open_ or state.get("next_key") is not None):
        raise bad("ended", "False unless an open pass has nothing pending and its source had ended")
    if state.get("next_key") is not None and (pending or not open_):
        raise bad("next_key", "None unless an open pass has nothing pending")
    next_shard = state.get("next_shard")
    if next_shard is not None and (not isinstance(next_shard, str) or pending or not open_):
        raise bad("next_shard", "None, or a shard file name where an open pass has nothing pending")
    tail = state.get("tail")  # states written before 2026-12-06 (fourteenth session) lack it
    if tail is not None and not (
        isinstance(tail, list | tuple)
        and all(
            isinstance(e, list | tuple) and len(e) == 2 and (e[1] is None or isinstance(e[1], str))
            for e in tail
        )
    ):
        raise bad("tail", "None, or the last input items finished as [key, shard file name] pairs")
    if not state.get("pass_read", True) and (pending or state["consumed"] or not open_):
        raise bad("pass_read", "True for a pass that has read (or False only for an open, unread one)")
    if state.get("source_abandoned") and (open_ and state.get("pass_read", True)):
        raise bad("source_abandoned", "False for a pass that has read its source")
    if not state.get("opened", True) and (open_ or state["counts"]["seen"]):
        raise bad("opened", "True for a stage that has opened a pass")


def override_names(override: Iterable[str]) -> set[str]:
    names = {override} if isinstance(override, str) else set(override)
    unknown = sorted(str(n) for n in names - set(RESUME_OVERRIDES))
    if unknown:
        raise ConfigError(
            f"override names settings the checkpoint may differ in: {list(RESUME_OVERRIDES)}; got {unknown}"
            + (
                " (batched cannot be overridden: positions count other things)"
                if "batched" in unknown
                else ""
            )
        )
    return names


class _Missing:
    """A setting one side does not name: a policy names its settings that are off only when on
    (``graded``, ``min_spread=None``), so their absence reads "not set", not damage (review,
    2026-12-06: "min_spread=(missing) in the checkpoint" read like a damaged checkpoint)."""

    def __repr__(self) -> str:
        return "(not set: off)"


MISSING = _Missing()


def same_value(a: Any, b: Any) -> bool:
    """Equal, and of the same types (``True`` is not the ``1`` a checkpoint recorded)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def plain_value(value: Any) -> Any:
    """A policy setting as a value ``torch.load(weights_only=True)`` reads back and ``==`` compares."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


#: Modules siftpipe's own policies lived in before the package was split into layers
#: (2026-12-03): a checkpoint written then names its policy's class by that path
_MOVED_MODULES = {"siftpipe.policies": "siftpipe.core.policies"}


def policy_class_name(name: Any) -> Any:
    """A checkpoint's ``policy_class`` as this version names the same class: a checkpoint of
    2026-12-01..03 names ``siftpipe.policies.InfoBatch``, and was refused as another policy
    altogether, with advice no stage could follow and its settings never compared (found by
    review, 2026-12-06)."""
    if isinstance(name, str):
        module, dot, qualname = name.rpartition(".")
        if module in _MOVED_MODULES:
            return f"{_MOVED_MODULES[module]}{dot}{qualname}"
    return name


def config_differences(
    state: Mapping[str, Any], mine: Mapping[str, Any], has_memory: bool
) -> list[tuple[str, str]]:
    """(override name, what differs) for each setting the checkpoint ``state`` does not share with
    a stage whose settings are ``mine`` (``Sifter._config()``) and that ``has_memory``."""
    theirs: dict[str, Any] = dict(state["config"])
    if "policy_class" in theirs:
        theirs["policy_class"] = policy_class_name(theirs["policy_class"])
    out: list[tuple[str, str]] = []
    for name, value in theirs.items():
        if name not in mine or same_value(mine[name], value):
            continue
        group = OVERRIDE_OF.get(name, name)
        if (
            name == "policy_config"
            and theirs.get("policy_class", mine["policy_class"]) != mine["policy_class"]
        ):
            continue  # another policy altogether: said once, by name
        if name == "memory" and (value is None or mine[name] is None):
            have = "holds no score memory" if value is None else "holds a score memory"
            out.append(
                (group, f"the checkpoint {have}, this stage {'has one' if value is None else 'has none'}")
            )
        elif isinstance(value, Mapping) and isinstance(mine[name], Mapping):
            for k in sorted(set(value) | set(mine[name])):
                a, b = value.get(k, MISSING), mine[name].get(k, MISSING)
                if not same_value(a, b):
                    what = "policy" if name == "policy_config" else name
                    out.append((group, f"{what} {k}={a!r} in the checkpoint, {b!r} here"))
        elif name == "policy":
            out.append((group, f"policy={value!r} in the checkpoint, policy={mine[name]!r} here"))
        elif name == "policy_class" and theirs.get("policy") == mine["policy"]:
            out.append((group, f"policy class {value} in the checkpoint, {mine[name]} here"))
        elif name != "policy_class":
            out.append((group, f"{name}={value!r} in the checkpoint, {name}={mine[name]!r} here"))
    # states of version 1 do not name their memory: its presence still has to match
    if "memory" not in theirs and (state.get("memory") is None) != (not has_memory):
        have = "holds a score memory" if state.get("memory") is not None else "holds no score memory"
        here = "has one" if has_memory else "has none"
        out.append(("memory", f"the checkpoint {have}, this stage {here}"))
    return out


def check_policy_entries(policy: Policy, state: Mapping[str, Any]) -> None:
    """What a version 2 state holds for a stage with ``policy`` (the policy itself checks
    the rest when it loads)."""
    history = state["policy"].get("history")
    if isinstance(policy, HistoryPolicy) and isinstance(history, Mapping) and "total" not in history:
        raise ResumeError(
            "the Sifter state's entry policy['history'] lacks 'total' (how many losses the window "
            "was given); the state is damaged, or not one Sifter.state_dict() wrote"
        )
    mine = f"{type(policy).__module__}.{type(policy).__qualname__}"
    if policy.weighted and policy_class_name(state["config"].get("policy_class")) == mine:
        for i, desc in enumerate(state["pending"]):
            if desc["weight"] is None:
                raise ResumeError(
                    f"the Sifter state's entry pending[{i}]['weight'] is None, but {policy!r} "
                    "weighs the samples it keeps; the state is damaged, or not this policy's"
                )


def carry_policy_state(policy: Policy, state: Mapping[str, Any]) -> None:
    """Load into ``policy`` what fits of another policy's state (``override=("policy",)``)."""
    fresh = policy.fresh().state_dict()
    if isinstance(policy, HistoryPolicy) and isinstance(state.get("history"), Mapping):
        values = state["history"].get("values")
        policy.load_state_dict(fresh)
        if isinstance(values, torch.Tensor):
            policy.history.extend(values.numpy().astype(np.float64))
        return
    try:
        policy.load_state_dict(dict(state))
    except Exception:
        policy.load_state_dict(fresh)


def check_account(account: Any, bad: Callable[[str, str], ResumeError]) -> None:
    """The cost account's entry: seconds >= 0, counts >= 0, a flag (``CostAccount.state_dict``)."""
    want = (
        "the cost account's counters: seconds and counts >= 0, 'warned', and 'pass_dropped' (if "
        "there) at most 'dropped'"
    )
    if not (
        isinstance(account, Mapping)
        and set(account) - {"pass_dropped"} == {*CostAccount.SECONDS, *CostAccount.COUNTS, "warned"}
        and all(
            isinstance(account[n], int | float) and not isinstance(account[n], bool) and account[n] >= 0
            for n in CostAccount.SECONDS
        )
        and all(is_int(account[n]) for n in CostAccount.COUNTS)
        and isinstance(account["warned"], bool)
        and (
            "pass_dropped" not in account
            or (is_int(account["pass_dropped"]) and 0 <= account["pass_dropped"] <= account["dropped"])
        )
    ):
        raise bad("account", want)
