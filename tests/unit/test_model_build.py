"""The model's build without processes: meta construction and seeded filling (dtk.models.init), activation
checkpointing and compile of the wrap units (dtk.models.units), and the recipe's lines for them."""
from __future__ import annotations

import pytest
import torch

from dtk import recipe as recipes
from dtk.data import build_dataset
from dtk.errors import DtkError
from dtk.models import build_model, model_blueprint
from dtk.models.units import prepare_units
from dtk.strategies.base import loss_fn


def _gpt(*overrides: str):
    r = recipes.build({}, ["data.seq_len=16", "data.vocab_size=32", "model.width=32", "model.heads=2", *overrides])
    return r, build_dataset(r.data, seed=0)


def test_weights_depend_on_the_seed_and_the_names_only():
    r2, data = _gpt("model.layers=2")
    r3, _ = _gpt("model.layers=3")
    two, three = build_model(r2.model, data.spec, seed=0), build_model(r3.model, data.spec, seed=0)
    again = build_model(r2.model, data.spec, seed=0)
    for name, p in two.state_dict().items():
        assert torch.equal(p, again.state_dict()[name]), name
        assert torch.equal(p, three.state_dict()[name]), name  # a third block changes nothing before it
    other = build_model(r2.model, data.spec, seed=1)
    assert not torch.equal(two.blocks[0].qkv.weight, other.blocks[0].qkv.weight)
    assert two.blocks[0].qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)  # nanoGPT's init, module by module


def test_the_blueprint_builds_on_meta_and_a_user_target_has_none():
    r, data = _gpt()
    meta = model_blueprint(r.model, data.spec, seed=0).meta()
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    target = recipes.build({}, ["model.target=tests.fixtures.hf_target:build"]).model
    assert model_blueprint(target, data.spec, seed=0) is None  # its constructor's init is kept: a full build


def test_a_blank_blueprint_draws_nothing_and_fills_zeros_unless_the_model_has_buffers():
    """A replacement in place builds blank (its state comes from parity); a model's buffers, which no rebuild
    restores, keep the seeded fill."""
    import dataclasses

    from torch import nn

    r, data = _gpt()
    blueprint = dataclasses.replace(model_blueprint(r.model, data.spec, seed=0), blank=True)
    seen = nn.init.normal_
    model = blueprint.full()
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())
    assert nn.init.normal_ is seen  # torch's init functions are back
    with_buffer = dataclasses.replace(blueprint, construct=lambda: nn.BatchNorm1d(4))
    assert torch.equal(with_buffer.full().weight, torch.ones(4))  # the seeded fill ran: BatchNorm's init


def _peak_bytes_and_grads(model, x, y):
    """The peak of the tensors alive in one forward and backward (activations are what checkpointing saves; torch's
    MemTracker counts them), the loss and the gradients."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        loss = loss_fn(model(x), y)
        loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], loss.item(), \
        [p.grad.clone() for p in model.parameters()]


def test_activation_checkpointing_keeps_the_numbers_and_saves_fewer_bytes():
    r, data = _gpt("model.layers=3", "data.seq_len=64", "model.width=64")
    x, y = data.batch(step=0, rank=0, micro=0, size=8)
    found = {}
    for mode in ("none", "selective", "full"):
        model = build_model(r.model, data.spec, seed=0)
        assert prepare_units(model, checkpointing=mode) == (0 if mode == "none" else 3)
        found[mode] = _peak_bytes_and_grads(model, x, y)
    none, selective, full = found["none"], found["selective"], found["full"]
    for got in (selective, full):
        assert got[1] == none[1]
        assert all(torch.equal(a, b) for a, b in zip(got[2], none[2]))
    assert full[0] < selective[0] < none[0], (full[0], selective[0], none[0])


@pytest.mark.parametrize("overrides, line", [
    (["training.activation_checkpointing=some"],
     "training.activation_checkpointing: got 'some'; input should be 'none', 'full' or 'selective'"),
    (["training.activation_checkpointing=selective", "strategy.name=zero3"],
     "training.activation_checkpointing: 'selective' is not offered for strategy.name 'zero3' (its losses drift "
     "from the run without); accepted: none, full"),
    (["training.compile=true", "strategy.name=zero2"],
     "training.compile: not offered for strategy.name 'zero2'; accepted strategies: ddp, fsdp"),
    (["training.compile=maybe"], "training.compile: got 'maybe'; input should be a valid boolean, unable to "
                                 "interpret input"),
])
def test_bad_values_are_one_line_each(overrides, line):
    with pytest.raises(DtkError) as info:
        recipes.build({}, overrides)
    assert info.value.lines == [line]


def test_compile_without_a_compiler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++ on PATH
    with pytest.raises(DtkError) as info:
        recipes.build({}, ["training.compile=true"])
    assert info.value.lines == ["training.compile: got true; torch.compile's inductor backend needs a C++ compiler "
                                "and g++ is not on PATH; accepted: install one (apt-get install g++, or name it in "
                                "CXX) or training.compile: false"]
