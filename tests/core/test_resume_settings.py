"""Resume refuses a checkpoint made with settings that change decisions or positions, names the
setting, and loads it anyway when told to with ``override=``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import siftpipe as sp
from tests.common import loss_field, make_samples, roundtrip
from tests.contract import output_keys

SAMPLES = make_samples(300, seed=11)


def checkpoint(**kw):
    """A mid-pass state of a stage built with ``kw`` (defaults below)."""
    s = stage(**kw)
    it = s(SAMPLES)
    for _ in range(5):
        next(it)
    return roundtrip(s.state_dict())


def stage(**kw):
    kw.setdefault("policy", sp.RelativeProbabilistic(1.0, 64))
    kw.setdefault("micro_batch", 16)
    kw.setdefault("seed", 2)
    return sp.Sifter(None, loss_field, **kw)


DIFFERENT = [
    (
        "beta",
        {"policy": sp.RelativeProbabilistic(1.0, 64)},
        {"policy": sp.RelativeProbabilistic(3.0, 64)},
        "policy",
    ),
    (
        "history",
        {"policy": sp.RelativeProbabilistic(1.0, 64)},
        {"policy": sp.RelativeProbabilistic(1.0, 32)},
        "policy",
    ),
    ("keep", {"policy": sp.Uniform(0.5)}, {"policy": sp.Uniform(0.3)}, "policy"),
    ("keep", {"policy": sp.TopFraction(0.5)}, {"policy": sp.TopFraction(0.25)}, "policy"),
    ("ratio", {"policy": sp.PruneEasy(0.5, None, 64)}, {"policy": sp.PruneEasy(0.7, None, 64)}, "policy"),
    ("anneal", {"policy": sp.PruneEasy(0.5, 1000, 64)}, {"policy": sp.PruneEasy(0.5, 2000, 64)}, "policy"),
    ("policy='relative_probabilistic'", {}, {"policy": sp.PruneEasy(0.5, None, 64)}, "policy"),
    ("on_nan='raise'", {}, {"on_nan": "keep"}, "on_nan"),
    ("seed=2", {}, {"seed": 3}, "seed"),
    ("delay=0", {}, {"delay": 10}, "delay"),
    ("micro_batch=16", {}, {"micro_batch": 8}, "micro_batch"),
    ("output_batch=None", {}, {"output_batch": 4}, "output_batch"),
    ("key='__key__'", {}, {"key": "y"}, "key"),
    (
        "max_age",
        {"memory": sp.ScoreMemory(1000, max_age=1)},
        {"memory": sp.ScoreMemory(1000, max_age=3)},
        "memory",
    ),
    ("capacity", {"memory": sp.ScoreMemory(1000)}, {"memory": sp.ScoreMemory(2000)}, "memory"),
    (
        "remember_forward",
        {"memory": sp.ScoreMemory(1000)},
        {"memory": sp.ScoreMemory(1000), "remember_forward": False},
        "memory",
    ),
    ("holds no score memory", {}, {"memory": sp.ScoreMemory(1000)}, "memory"),
    (
        "unknown='score'",
        {"memory": sp.ScoreMemory(1000)},
        {"memory": sp.ScoreMemory(1000), "unknown": "keep"},
        "unknown",
    ),
]


@pytest.mark.parametrize("what,saved,loaded,override", DIFFERENT, ids=[f"{d[0]}-{d[3]}" for d in DIFFERENT])
def test_a_setting_that_changes_decisions_is_refused_by_name_unless_overridden(what, saved, loaded, override):
    state = checkpoint(**saved)
    with pytest.raises(sp.ResumeError, match=rf"(?s){what}.*override=\('{override}',\)"):
        stage(**loaded).load_state_dict(state)
    s = stage(**loaded)
    s.load_state_dict(state, override=(override,))
    assert len(output_keys(s(SAMPLES[state["consumed"] :]))) > 0


def test_a_checkpoint_with_a_memory_loaded_into_a_stage_without_one_is_refused():
    state = checkpoint(memory=sp.ScoreMemory(1000))
    with pytest.raises(sp.ResumeError, match="holds a score memory, this stage has none"):
        stage().load_state_dict(state)
    stage().load_state_dict(state, override="memory")


def test_override_policy_carries_the_loss_history_into_the_new_window():
    state = checkpoint(policy=sp.RelativeProbabilistic(1.0, 64))
    saved = state["policy"]["history"]["values"].numpy()
    policy = sp.PruneEasy(0.5, None, 32)
    stage(policy=policy).load_state_dict(state, override=["policy"])
    assert np.array_equal(policy.history.values(), saved[-32:])


def test_override_seed_restarts_the_generator_from_this_stages_seed():
    state = checkpoint(policy=sp.Uniform(0.5))
    a = stage(policy=sp.Uniform(0.5), seed=9)
    a.load_state_dict(state, override=("seed",))
    b = stage(policy=sp.Uniform(0.5))
    b.load_state_dict(state)
    fresh = np.random.default_rng(9).random(8)
    assert np.array_equal(a._decider.rng.random(8), fresh)
    assert not np.array_equal(b._decider.rng.random(8), fresh)


def test_a_stage_made_before_the_ranks_were_known_draws_as_its_rank_from_its_first_pass(monkeypatch):
    # found by review: a Sifter made in an mp.spawn worker before init_process_group (no $RANK)
    # seeded every rank alike, while its checkpoints named their ranks
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    early = [stage(policy=sp.Uniform(0.5)) for _ in range(2)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    kept = []
    for rank, s in enumerate(early):
        monkeypatch.setenv("RANK", str(rank))
        kept.append(output_keys(s(SAMPLES)))
        assert s.rng_seed == [2, rank]
        made_late = stage(policy=sp.Uniform(0.5))
        assert output_keys(made_late(SAMPLES)) == kept[-1]  # as a stage made after the ranks
    assert kept[0] != kept[1]


def test_another_ranks_checkpoint_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    state = checkpoint()
    with_log = checkpoint(audit=sp.AuditLog(str(tmp_path / "log"), run_id="r", writer="thread"))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(sp.ResumeError, match=r"rank=1 in the checkpoint, rank=0 here.*override=\('rank',\)"):
        stage().load_state_dict(state)
    stage().load_state_dict(state, override=("rank",))
    for override in ((), ("rank",)):
        s = stage(audit=sp.AuditLog(str(tmp_path / "log"), run_id="r", writer="thread"))
        with pytest.raises(sp.ResumeError, match="rank 1's audit stream.*rank 0's"):
            s.load_state_dict(with_log, override=override)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(sp.ResumeError, match="world=2 in the checkpoint, world=4 here"):
        stage().load_state_dict(state)


def test_an_audit_log_given_another_rank_is_refused(tmp_path):
    log = sp.AuditLog(str(tmp_path / "log"), run_id="r", rank=1, writer="thread")
    state = checkpoint(audit=log)
    log.close()
    with pytest.raises(sp.ResumeError, match="rank 1's audit stream"):
        stage(audit=sp.AuditLog(str(tmp_path / "log"), rank=0, writer="thread")).load_state_dict(state)


def test_settings_that_do_not_change_decisions_are_not_compared():
    state = checkpoint(policy=sp.PruneEasy(0.5, None, 64), attach_weight=False)
    reference = stage(policy=sp.PruneEasy(0.5, None, 64), attach_weight=True)
    expected = [(o["__key__"], o["__sift_weight__"]) for o in reference(SAMPLES)]
    s = stage(
        policy=sp.PruneEasy(0.5, None, 64),
        attach_weight=True,
        pin_memory=True,
        eval_mode=False,
        autocast=torch.bfloat16,
        on_oom="split",
        pad_micro_batch=True,
        device="cpu",
    )
    s.load_state_dict(state)
    # the decided weights of the pending samples are in the state even when none were attached
    tail = [(o["__key__"], o["__sift_weight__"]) for o in s(SAMPLES[state["consumed"] :])]
    assert tail == expected[len(expected) - len(tail) :]


def test_override_names_are_checked():
    state = checkpoint()
    with pytest.raises(sp.ConfigError, match="batched cannot be overridden"):
        stage().load_state_dict(state, override=("batched",))
    with pytest.raises(sp.ConfigError, match=r"\['bta'\]"):
        stage().load_state_dict(state, override=("bta",))
    with pytest.raises(sp.ResumeError, match="batched=False in the checkpoint"):
        stage(batched=True).load_state_dict(state)


def test_a_version_1_state_still_loads():
    s = stage()
    it = s(SAMPLES)
    head = output_keys([next(it) for _ in range(5)])
    state = roundtrip(s.state_dict())
    added = ("epoch_set", "opened", "pass_read", "read", "next_key", "ended", "source_abandoned", "checks")
    old = {k: v for k, v in state.items() if k not in added}
    old["policy"] = {"history": {k: v for k, v in state["policy"]["history"].items() if k != "total"}}
    old["version"] = 1
    old["config"] = {
        k: state["config"][k] for k in ("micro_batch", "batched", "output_batch", "delay", "policy")
    }
    t = stage()
    t.load_state_dict(old)
    assert head + output_keys(t(SAMPLES[state["consumed"] :])) == output_keys(stage()(SAMPLES))


@pytest.mark.parametrize(
    "policy",
    [sp.RelativeProbabilistic(1.0, 64), sp.PruneEasy(0.5, None, 64), sp.InfoBatch(ratio=0.3, budget=900)],
    ids=["relative", "prune_easy", "infobatch"],
)
def test_a_checkpoint_naming_the_policys_module_before_the_layering_resumes_exactly(policy):
    """Checkpoints of 2026-12-01..03 name the policy's class ``siftpipe.policies.X`` (the module
    before the package was split into layers): they were refused as another policy altogether,
    with advice no stage could follow ("construct the Sifter with the checkpoint's setting"), and
    the settings that did differ were never named (found by review, 2026-12-06)."""
    from siftpipe.core.state import digest

    def made():
        memory = sp.ScoreMemory(1000) if isinstance(policy, sp.InfoBatch) else None
        return stage(policy=policy.fresh(), memory=memory, output_batch=6)

    first = made()
    it = first(SAMPLES)
    head = output_keys([next(it) for _ in range(5)])
    state = roundtrip(first.state_dict())
    whole = head + output_keys(it)
    name = type(policy).__name__
    assert state["config"]["policy_class"] == f"siftpipe.core.policies.{name}"
    state["config"]["policy_class"] = f"siftpipe.policies.{name}"  # as the older version wrote it
    state["checks"]["config"] = digest(state["config"])
    again = made()
    again.load_state_dict(state)
    assert head + output_keys(again(SAMPLES[state["consumed"] :])) == whole
    # a setting that differs is named, not the class
    if isinstance(policy, sp.RelativeProbabilistic):
        other = stage(policy=sp.RelativeProbabilistic(2.0, 64), output_batch=6)
        with pytest.raises(sp.ResumeError, match=r"policy beta=1.0 in the checkpoint, 2.0 here") as err:
            other.load_state_dict(state)
        assert "policy class" not in str(err.value)
