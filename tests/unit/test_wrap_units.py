"""FSDP's wrap units without processes: a transformers model's `_no_split_modules`, the largest nn.ModuleList of
repeated blocks for any other model, the classes a user names in strategy.wrap, and ties that must not be split."""
from __future__ import annotations

import pytest
from torch import nn

from dtk.errors import DtkError
from dtk.models.gpt import GPT
from dtk.models.wrap import find_wrap_units


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)


class TwoStacks(nn.Module):
    """A small stack of wide blocks and a long stack of narrow ones, plus a list of mixed layers (not blocks)."""

    def __init__(self):
        super().__init__()
        self.narrow = nn.ModuleList([nn.Linear(4, 4) for _ in range(6)])
        self.wide = nn.ModuleList([Block(32) for _ in range(3)])
        self.mixed = nn.ModuleList([nn.Linear(64, 64), nn.Conv1d(64, 64, 3)])
        self.head = nn.Linear(32, 2)


def test_a_plain_model_is_sharded_by_the_members_of_its_largest_block_list():
    units = find_wrap_units(TwoStacks())
    assert units.names == ["wide.0", "wide.1", "wide.2"]
    assert units.summary() == {"count": 3, "classes": {"Block": 3}, "source": "largest ModuleList wide",
                               "root": "TwoStacks"}


def test_dtks_own_gpt_keeps_its_blocks_as_units():
    units = find_wrap_units(GPT(vocab_size=16, context=8, layers=3, width=16, heads=2))
    assert units.names == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_model_without_blocks_has_only_its_root():
    units = find_wrap_units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert units.modules == [] and units.source == "none"


def test_named_classes_win_and_come_deepest_first():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.outer = nn.ModuleList([nn.Sequential(Block(8), Block(8)) for _ in range(2)])

    units = find_wrap_units(Nested(), names=["Block", "Sequential"])
    assert units.source == "strategy.wrap"
    assert units.classes == ["Block"] * 4 + ["Sequential"] * 2  # fully_shard sees every child before its parent


def test_an_unknown_class_is_one_line_naming_it():
    with pytest.raises(DtkError) as info:
        find_wrap_units(TwoStacks(), names=["Block", "GPT2Block"])
    assert len(info.value.lines) == 1
    assert "strategy.wrap" in info.value.lines[0] and "'GPT2Block'" in info.value.lines[0]
    assert "Block" in info.value.lines[0]  # what would be accepted


def _tiny(model_type: str, **fields):
    pytest.importorskip("transformers")  # the optional extra: pip install -e ".[hf]"
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=32, **fields))


@pytest.mark.parametrize("model_type, fields, block", [
    ("gpt2", {"n_layer": 3, "n_embd": 16, "n_head": 2, "n_positions": 8}, "GPT2Block"),
    ("llama", {"num_hidden_layers": 3, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32},
     "LlamaDecoderLayer"),
])
def test_a_transformers_model_is_sharded_by_its_no_split_modules(model_type, fields, block):
    model = _tiny(model_type, **fields)
    units = find_wrap_units(model)
    assert units.summary() == {"count": 3, "classes": {block: 3}, "source": "_no_split_modules",
                               "root": type(model).__name__}


def test_a_wrapped_transformers_model_still_gives_its_blocks():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = _tiny("gpt2", n_layer=2, n_embd=16, n_head=2, n_positions=8)

    assert find_wrap_units(Wrapper()).classes == ["GPT2Block", "GPT2Block"]


def test_units_that_would_split_tied_embeddings_are_refused():
    model = _tiny("gpt2", n_layer=2, n_embd=16, n_head=2, n_positions=8)  # lm_head.weight is wte.weight
    with pytest.raises(DtkError) as info:
        find_wrap_units(model, names=["Embedding"])
    assert len(info.value.lines) == 1 and "tied" in info.value.lines[0]
