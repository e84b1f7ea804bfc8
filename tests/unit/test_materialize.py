"""Asking a fresh engine for its local state (parity does it before the first update) must not change the run."""
from __future__ import annotations

import pytest
import torch

from dtk.recipe import OptimizerConfig
from dtk.strategies.base import build_torch_optimizer, materialize_optimizer_state, square_sum


def _train(*, materialize_first: bool, cfg: OptimizerConfig) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = build_torch_optimizer(model.parameters(), cfg)
    if materialize_first:
        materialize_optimizer_state(opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cfg", [OptimizerConfig(name="adamw", weight_decay=0.1, lr=0.01),
                                 OptimizerConfig(name="sgd", momentum=0.9, weight_decay=0.1, lr=0.01)])
def test_materialized_state_trains_like_lazy_state(cfg):
    lazy, early = _train(materialize_first=False, cfg=cfg), _train(materialize_first=True, cfg=cfg)
    assert all(torch.equal(a, b) for a, b in zip(lazy, early))


def test_the_reported_square_sum_is_the_float64_sum_of_squares_with_missing_grads_skipped():
    torch.manual_seed(0)
    tensors = [torch.randn(3), None, torch.randn(40, 50), torch.randn(7).to(torch.bfloat16)]
    want = sum(float(t.double().pow(2).sum()) for t in tensors if t is not None)
    assert square_sum(tensors) == pytest.approx(want, rel=1e-12)
    assert square_sum([]) == square_sum([None]) == 0.0
