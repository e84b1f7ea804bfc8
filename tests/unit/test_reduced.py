"""What a roll forward keeps of a step's reduce-scatters (dtk.resilience.reduced): the survivors' kept bytes give a
lost rank its reduced chunks bit for bit, in even and odd worlds, and a step whose reduce-scatters never completed
leaves the last step's record in place."""
from __future__ import annotations

import pytest
import torch

from dtk.resilience.reduced import ReducedGrads


def _ranks_after_a_step(world: int, step: int, calls: list[torch.Tensor]) -> list[tuple[ReducedGrads, list]]:
    """Every rank's keeper after `step`'s reduce-scatters of `calls` (each world x n, as the all-reduce leaves them)."""
    out = []
    for rank in range(world):
        kept = ReducedGrads(rank=rank, world=world)
        kept.begin(step)
        outputs = [torch.empty(buf.shape[1]) for buf in calls]
        for buf, o in zip(calls, outputs):
            kept.add(buf, o)
        kept.seal(step, {o.untyped_storage().data_ptr(): key for key, o in enumerate(outputs)})
        out.append((kept, outputs))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_survivors_bytes_give_the_lost_rank_its_chunks(world):
    torch.manual_seed(world)
    calls = [torch.randn(world, 37), torch.randn(world, 5)]  # odd sizes: not a whole number of 8-byte words
    ranks = _ranks_after_a_step(world, 7, calls)
    for lost in range(world):
        survivors = [r for r in range(world) if r != lost]
        total = None
        for r in survivors:
            part = ranks[r][0].contribution(survivors=survivors)
            total = part.clone() if total is None else total.bitwise_xor_(part)
        want = torch.cat([buf[lost].view(torch.uint8) for buf in calls])
        assert torch.equal(total, want)
    kept = ranks[0][0]
    assert kept.sealed == 7 and kept.order == [0, 1]
    per_shard = sum(buf[0].numel() * 4 for buf in calls)
    assert kept.nbytes == per_shard * (2 if world % 2 else 1)  # an odd world also keeps its own chunks


def test_a_step_without_a_whole_reduce_scatter_keeps_the_last_record():
    calls = [torch.randn(2, 8)]
    kept, outputs = _ranks_after_a_step(2, 3, calls)[1]
    kept.begin(4)  # a peer failed before any of step 4's reduce-scatters completed
    kept.seal(4, {})
    assert kept.sealed == 3 and kept.step == 3
    kept.begin(4)  # step 4 again: its first reduce-scatter replaces the record, which is sealed when matched
    o = torch.empty(8)
    kept.add(torch.randn(2, 8), o)
    assert kept.sealed == -1
    kept.seal(4, {o.untyped_storage().data_ptr(): 0, 12345: 1})  # a gradient no reduce-scatter here made
    assert kept.sealed == -1


def test_the_recipe_offers_roll_forward_where_one_rank_can_make_its_update():
    from dtk import recipe
    from dtk.errors import DtkError

    assert recipe.build({}, ["strategy.name=fsdp", "resilience.roll_forward=true"]).resilience.roll_forward
    for extra, line in ((["strategy.name=zero2"], "resilience.roll_forward: not offered for strategy.name 'zero2'; "
                                                  "accepted strategies: fsdp, zero3 (ddp redoes nothing already)"),
                        (["strategy.name=fsdp", "optimizer.grad_clip=1"],
                         "resilience.roll_forward: not offered with optimizer.grad_clip 1.0 (a clipped update needs "
                         "every rank's norm); accepted: optimizer.grad_clip 0")):
        with pytest.raises(DtkError) as e:
            recipe.build({}, [*extra, "resilience.roll_forward=true"])
        assert e.value.lines == [line]


def test_a_reduce_scatter_of_several_parameters_is_kept_as_one_piece_each():
    """ZeRO-3 reduces a bucket of parameters in one reduce-scatter: the engine names the pieces of its output
    (key, bytes), and each becomes an entry the lost rank gets back by its key."""
    world, calls = 3, [torch.randn(3, 12)]  # one bucket: a parameter of 4 elements' shard, then one of 8
    ranks = []
    for rank in range(world):
        kept = ReducedGrads(rank=rank, world=world)
        kept.begin(2)
        kept.add(calls[0], torch.empty(12))
        kept.seal(2, [[(5, 16), (9, 32)]])
        ranks.append(kept)
    assert ranks[0].sealed == 2 and ranks[0].order == [5, 9] and ranks[0].sizes() == [16, 32]
    survivors = [0, 2]
    total = ranks[0].contribution(survivors=survivors).bitwise_xor_(ranks[2].contribution(survivors=survivors))
    assert torch.equal(total, calls[0][1].view(torch.uint8))
    wrong = ReducedGrads(rank=0, world=world)
    wrong.begin(2)
    wrong.add(calls[0], torch.empty(12))
    wrong.seal(2, [[(5, 16), (9, 16)]])  # pieces that do not make up the output
    assert wrong.sealed == -1 and wrong.order == []
