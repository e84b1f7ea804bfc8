"""transformers models (model.hf) under every strategy: two real ranks on gloo, in one spawn. GPT-2 (tied input and
output embeddings) and Llama give the same losses under ddp, fsdp, zero1, zero2 and zero3; FSDP shards them block
by block; a transformers model brought through model.target trains the same way."""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from dtk.rendezvous import free_port

pytest.importorskip("transformers")
pytestmark = [pytest.mark.dist]

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
COMMON = ["data.seq_len=16", "data.vocab_size=32", "training.micro_batch=4"]
MODELS = {
    "gpt2": ["model.hf.model_type=gpt2", "model.hf.config.n_layer=2", "model.hf.config.n_embd=32",
             "model.hf.config.n_head=2"],
    "llama": ["model.hf.model_type=llama", "model.hf.config.num_hidden_layers=2", "model.hf.config.hidden_size=32",
              "model.hf.config.num_attention_heads=4", "model.hf.config.num_key_value_heads=2",
              "model.hf.config.intermediate_size=64"],
    "target": ["model.target=tests.fixtures.hf_target:build"],
}
TARGET_STRATEGIES = ["ddp", "fsdp"]
STEPS = 4


def _model_of(engine):
    m = engine.module
    return getattr(m, "module", m)  # DDP wraps the model; FSDP2 and DeepSpeed keep it as the module


def _rank_main(rank: int, world: int, port: int, results) -> None:
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dtk import recipe
    from dtk.comm.group import register
    from dtk.data import build_dataset
    from dtk.models import build_model, model_blueprint
    from dtk.strategies import META_INIT, BuildContext, build_engine

    register()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("dtk", store=store, rank=rank, world_size=world)
    out = {}
    for strategy in STRATEGIES:  # zero3 last: DeepSpeed's stage 3 leaves hooks behind
        for name, overrides in MODELS.items():
            if name == "target" and strategy not in TARGET_STRATEGIES:
                continue
            r = recipe.build({}, [*COMMON, *overrides, f"strategy.name={strategy}"])
            data = build_dataset(r.data, seed=0)
            # fsdp and zero3 build on meta and fill their shards (a model.target has no blueprint: built whole)
            blueprint = model_blueprint(r.model, data.spec, seed=0) if strategy in META_INIT else None
            ctx = BuildContext(model_factory=lambda: build_model(r.model, data.spec, seed=0), recipe=r,
                               group=dist.group.WORLD, device=torch.device("cpu"), blueprint=blueprint)
            engine = build_engine(strategy, ctx)
            losses = []
            for step in range(STEPS):
                x, y = data.batch(step=step, rank=rank, micro=0, size=4)
                losses.append(float(engine.forward_backward(x, y, last_micro=True)))
                engine.optimizer_step()
            model = _model_of(engine)
            out[f"{name}/{strategy}"] = {
                "losses": losses,
                "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
                "wrap_units": engine.wrap_units.summary() if strategy == "fsdp" else None,
            }
    results[rank] = out
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained():
    world = 2
    results = mp.Manager().dict()
    mp.start_processes(_rank_main, args=(world, free_port(), results), nprocs=world, start_method="spawn")
    return dict(results)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hf_model_matches_ddp_under_every_strategy(trained, model, strategy):
    for rank in (0, 1):
        got, want = trained[rank][f"{model}/{strategy}"]["losses"], trained[rank][f"{model}/ddp"]["losses"]
        assert len(got) == STEPS and got[-1] < got[0], got
        assert got == pytest.approx(want, rel=1e-5), f"{model} under {strategy} vs ddp on rank {rank}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_embeddings_stay_tied_under_every_strategy(trained, strategy):
    """GPT-2's head is its input embedding: one parameter, one update (the equal losses above show the update)."""
    assert trained[0][f"gpt2/{strategy}"]["tied"]
    assert not trained[0][f"llama/{strategy}"]["tied"]  # Llama unties them by default: both cases are covered


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, block", [("gpt2", "GPT2Block"), ("llama", "LlamaDecoderLayer"), ("target", "GPT2Block")])
def test_fsdp_shards_transformers_models_block_by_block(trained, model, block):
    units = trained[0][f"{model}/fsdp"]["wrap_units"]
    assert units["classes"] == {block: 2} and units["count"] == 2
    assert units["source"] == "_no_split_modules"


@pytest.mark.timeout(600)
def test_a_transformers_model_through_model_target_gives_its_logits(trained):
    """model.target returning a transformers model (a ModelOutput, not a tensor) trains, under ddp and fsdp alike."""
    for rank in (0, 1):
        ddp, fsdp = trained[rank]["target/ddp"]["losses"], trained[rank]["target/fsdp"]["losses"]
        assert ddp[-1] < ddp[0]
        assert fsdp == pytest.approx(ddp, rel=1e-5)
