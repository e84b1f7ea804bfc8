"""Every strategy's loss takes the logits from whatever a model returns: a tensor, a tuple, or an object with
`.logits` (transformers' ModelOutput); anything else is one clear line."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from dtk.errors import DtkError
from dtk.strategies.base import logits_of, loss_fn


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


LOGITS = torch.randn(2, 5, 7)
Y = torch.randint(0, 7, (2, 5))


@pytest.mark.parametrize("output", [LOGITS, (LOGITS, torch.zeros(1)), [LOGITS], Output(loss=None, logits=LOGITS),
                                    {"logits": LOGITS}], ids=["tensor", "tuple", "list", "logits attribute", "dict"])
def test_logits_come_out_of_every_shape_of_output(output):
    assert logits_of(output) is LOGITS
    assert loss_fn(output, Y) == loss_fn(LOGITS, Y)


def test_a_transformers_model_output_gives_its_logits():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    assert logits_of(CausalLMOutput(logits=LOGITS)) is LOGITS


def test_a_tuple_model_trains_through_the_loss():
    class TupleModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 7)

        def forward(self, x):
            logits = self.embed(x)
            return logits, logits.mean()

    model = TupleModel()
    loss_fn(model(Y), Y).backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("output", [{"scores": LOGITS}, "logits", ()], ids=["dict without logits", "str", "empty tuple"])
def test_anything_else_is_one_line_saying_what_is_accepted(output):
    with pytest.raises(DtkError) as info:
        logits_of(output)
    assert len(info.value.lines) == 1 and "accepted" in info.value.lines[0]
