"""LR schedules against their formulas, the recipe's checks on them, and the optimizer's no-decay groups."""
from __future__ import annotations

import math

import pytest
import torch

from dtk import recipe
from dtk.errors import DtkError
from dtk.schedule import lr_at
from dtk.strategies.base import build_torch_optimizer
from dtk.strategies.param_groups import split_no_decay

STEPS, LR, LOW, WARM = 20, 1e-2, 1e-3, 4


def _curve(schedule: str, **extra) -> list[float]:
    r = recipe.build({}, [f"training.steps={STEPS}", f"optimizer.lr={LR}", f"optimizer.min_lr={LOW}",
                          f"optimizer.warmup_steps={WARM}", f"optimizer.schedule={schedule}",
                          *[f"optimizer.{k}={v}" for k, v in extra.items()]])
    return [lr_at(s, cfg=r.optimizer, total_steps=STEPS) for s in range(STEPS)]


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_each_schedule_follows_its_formula(schedule):
    got = _curve(schedule, **({"decay_steps": 5} if schedule == "wsd" else {}))
    for s in range(WARM):  # linear warmup, never 0
        assert got[s] == pytest.approx(LR * (s + 1) / (WARM + 1), rel=1e-12)
    for s in range(WARM, STEPS):
        n = s + 1
        if schedule == "constant":
            want = LR
        elif schedule == "cosine":
            want = LOW + (LR - LOW) * 0.5 * (1 + math.cos(math.pi * (s - WARM) / (STEPS - 1 - WARM)))
        elif schedule == "linear":
            want = LOW + (LR - LOW) * (1 - (s - WARM) / (STEPS - 1 - WARM))
        else:  # stable until the last 5 steps, then linear to min_lr
            want = LR if n <= STEPS - 5 else LOW + (LR - LOW) * (1 - (n - (STEPS - 5)) / 5)
        assert got[s] == pytest.approx(want, rel=1e-12), s
    assert max(got) == pytest.approx(LR)
    if schedule != "constant":
        assert got[-1] == pytest.approx(LOW)  # the last step decays all the way


def test_wsd_decays_over_the_last_tenth_by_default():
    got = _curve("wsd")
    assert got[STEPS - 3] == LR and got[STEPS - 2] < LR and got[-1] == pytest.approx(LOW)


@pytest.mark.parametrize("overrides, says", [
    (["optimizer.schedule=exponential"], "optimizer.schedule: got 'exponential'"),
    (["optimizer.min_lr=0.1", "optimizer.lr=0.01"], "optimizer.min_lr: got 0.1; must be <= optimizer.lr (0.01)"),
    (["optimizer.warmup_steps=10", "training.steps=10"], "optimizer.warmup_steps: got 10; must be < training.steps"),
    (["optimizer.decay_steps=3"], "optimizer.decay_steps: got 3; only schedule 'wsd' uses it"),
    (["optimizer.schedule=wsd", "optimizer.decay_steps=8", "optimizer.warmup_steps=5", "training.steps=10"],
     "warmup_steps + decay_steps must be <= training.steps (10)"),
    (["training.warmup_steps=3"], "training.warmup_steps: renamed: the learning rate's warmup is "
                                  "optimizer.warmup_steps; the steps left out of timing figures are "
                                  "training.untimed_steps"),
])
def test_bad_schedule_input_is_one_line(overrides, says):
    with pytest.raises(DtkError) as e:
        recipe.build({}, overrides)
    assert len(e.value.lines) == 1 and says in e.value.lines[0], e.value.lines


def _gpt():
    from dtk.data import build_dataset
    from dtk.models import build_model

    r = recipe.build({}, ["model.layers=1", "model.width=16", "model.heads=2", "data.seq_len=8"])
    return build_model(r.model, build_dataset(r.data, seed=0).spec, seed=0)


def _names(model, params):
    ids = {id(p) for p in params}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_no_decay_on_biases_norms_and_embeddings():
    model = _gpt()
    decay, keep = split_no_decay(model, ["bias", "norm", "embedding"])
    assert _names(model, decay) == ["blocks.0.fc.weight", "blocks.0.out.weight", "blocks.0.proj.weight",
                                    "blocks.0.qkv.weight", "head.weight"]
    assert "tok.weight" in _names(model, keep) and "blocks.0.ln1.weight" in _names(model, keep)
    assert len(decay) + len(keep) == len(list(model.parameters()))
    _, keep = split_no_decay(model, ["bias", "blocks.*.qkv.weight"])  # a glob on names; embeddings decayed now
    assert "blocks.0.qkv.weight" in _names(model, keep) and "tok.weight" not in _names(model, keep)
    opt = build_torch_optimizer(model, recipe.build({}, ["optimizer.weight_decay=0.1"]).optimizer)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    opt = build_torch_optimizer(model, recipe.build({}, ["optimizer.weight_decay=0.1", "optimizer.no_decay=[]"]).optimizer)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.1


def test_a_no_decay_glob_that_matches_nothing_is_one_line():
    with pytest.raises(DtkError, match=r"optimizer.no_decay: got 'blocks.\*.nope'; it is no category"):
        split_no_decay(_gpt(), ["blocks.*.nope"])
    torch.manual_seed(0)
