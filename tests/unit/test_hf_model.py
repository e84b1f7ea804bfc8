"""model.hf without processes: the config dtk builds (the data's vocabulary and context unless given), a local folder
with or without weights, and what the recipe check refuses, each as one line naming the field."""
from __future__ import annotations

import pytest
import torch

from dtk import recipe as recipes
from dtk.data import DataSpec
from dtk.errors import DtkError

pytest.importorskip("transformers")

from dtk.models.hf import build_hf, make_config  # noqa: E402  (after the skip: needs the hf extra)

SPEC = DataSpec(kind="tokens", vocab_size=40, seq_len=24)
GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2}


def hf(**fields) -> recipes.HFModelConfig:
    return recipes.HFModelConfig(**fields)


def test_vocabulary_and_context_come_from_the_data_unless_given():
    config = make_config(hf(model_type="gpt2", config=GPT2), SPEC)
    assert (config.vocab_size, config.n_positions, config.n_layer, config.use_cache) == (40, 24, 2, False)
    assert config.bos_token_id is None  # GPT-2's 50256 is no token of this data
    given = make_config(hf(model_type="gpt2", config={**GPT2, "vocab_size": 64, "max_position_embeddings": 32,
                                                      "use_cache": True}), SPEC)
    assert (given.vocab_size, given.n_positions, given.use_cache) == (64, 32, True)


def test_llama_takes_the_context_as_max_position_embeddings():
    config = make_config(hf(model_type="llama", config={"hidden_size": 32, "num_attention_heads": 4}), SPEC)
    assert (config.vocab_size, config.max_position_embeddings, config.head_dim) == (40, 24, 8)


def test_a_folder_with_weights_is_loaded_and_one_without_is_built_fresh(tmp_path):
    torch.manual_seed(1)
    saved = build_hf(hf(model_type="gpt2", config=GPT2), SPEC)
    saved.save_pretrained(tmp_path / "with")
    saved.config.save_pretrained(tmp_path / "without")

    torch.manual_seed(2)
    loaded = build_hf(hf(path=str(tmp_path / "with")), SPEC)
    assert loaded.training, "from_pretrained leaves eval mode; dtk trains"
    assert loaded.config.use_cache is False
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.lm_head.weight is loaded.transformer.wte.weight

    torch.manual_seed(2)
    fresh = build_hf(hf(path=str(tmp_path / "without")), SPEC)
    assert fresh.config.n_layer == 2
    assert not torch.equal(fresh.transformer.wte.weight, saved.transformer.wte.weight)


def errors_of(*overrides: str) -> list[str]:
    with pytest.raises(DtkError) as info:
        recipes.build({}, ["data.vocab_size=40", "data.seq_len=24", *overrides])
    return info.value.lines


@pytest.mark.parametrize("overrides, mentions", [
    (["model.hf.model_type=gpt3"], ["model.hf.model_type", "'gpt3'", "gpt2"]),
    (["model.hf.model_type=gpt2", "model.hf.config.n_layers=2"], ["model.hf.config.n_layers", "n_layer"]),
    (["model.hf.model_type=gpt2", "model.hf.config.vocab_size=20"], ["model.hf.config.vocab_size", "20", ">= 40"]),
    (["model.hf.model_type=gpt2", "model.hf.config.n_positions=8"], ["n_positions", "8", ">= 24"]),
    (["model.hf.model_type=gpt2", "model.hf.config.n_embd=30", "model.hf.config.n_head=4"],
     ["model.hf.config", "divisible"]),
    (["model.hf.model_type=gpt2", "model.hf.path=x"], ["model.hf", "exactly one"]),
    (["model.hf.path=no/such/folder"], ["model.hf.path", "'no/such/folder'", "config.json"]),
    (["model.hf.model_type=gpt2", "model.target=a.b:c"], ["model.target", "model.hf"]),
    (["model.hf.model_type=gpt2", "data.name=digits"], ["model.hf", "'digits'"]),
    (["model.hf.model_type=gpt2", "strategy.name=fsdp", "strategy.wrap=[GPTBlock]"], ["strategy.wrap", "'GPTBlock'"]),
], ids=["unknown type", "unknown field", "small vocab", "short context", "refused by transformers", "type and path",
        "no config.json", "target and hf", "image data", "unknown wrap class"])
def test_the_recipe_check_refuses_with_one_line(overrides, mentions):
    lines = errors_of(*overrides)
    assert len(lines) == 1, lines
    for text in mentions:
        assert text in lines[0], lines


def test_a_good_hf_recipe_passes_the_check():
    r = recipes.build({}, ["model.hf.model_type=llama", "model.hf.config.hidden_size=32",
                           "model.hf.config.num_attention_heads=4", "strategy.name=fsdp",
                           "strategy.wrap=[LlamaDecoderLayer]"])
    assert r.model.hf.model_type == "llama" and r.strategy.wrap == ["LlamaDecoderLayer"]


def test_config_fields_that_do_not_fit_a_folders_weights_are_one_line(tmp_path):
    """README's `model.hf.path=...` over recipes/hf-gpt2.yaml: its n_layer/n_embd would not fit the folder's weights
    (a rank's ignore_mismatched_sizes traceback before); dropout fits; model.hf.config={} takes the folder as saved."""
    build_hf(hf(model_type="gpt2", config={"n_layer": 1, "n_embd": 32, "n_head": 2}), SPEC).save_pretrained(tmp_path)
    folder = ["model.hf.model_type=null", f"model.hf.path={tmp_path}", "data.vocab_size=40", "data.seq_len=24"]
    shipped = recipes.read_file(recipes.Path(__file__).parents[2] / "recipes" / "hf-gpt2.yaml")
    shipped.pop("data")  # its text file is read relative to the repository root: the synthetic data here
    with pytest.raises(DtkError) as info:
        recipes.build(shipped, folder)
    assert info.value.lines == [f"model.hf.config.n_layer: got 2; the weights in model.hf.path {str(tmp_path)!r} were "
                                f"saved with n_layer=1, and n_embd=64 (saved: 32); accepted: fields that keep the "
                                f"weights' shapes (dropout, ...), or model.hf.config={{}} (the folder's config.json "
                                f"as saved)"]
    assert recipes.build(shipped, [*folder, "model.hf.config={attn_pdrop: 0.0}"]).model.hf.config == {"attn_pdrop": 0.0}
    assert recipes.build(shipped, [*folder, "model.hf.config={}"]).model.hf.config == {}
