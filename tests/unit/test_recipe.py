"""Recipe loading without processes: defaults, file values, `a.b=c` overrides, round-trip, errors all at once."""
from __future__ import annotations

from pathlib import Path

import pytest

from dtk import recipe as recipes
from dtk.errors import DtkError


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def errors_of(path: Path, overrides: list[str] = ()) -> list[str]:
    with pytest.raises(DtkError) as info:
        recipes.load(path, list(overrides))
    return info.value.lines


def test_empty_file_gives_the_defaults(tmp_path):
    r = recipes.load(write(tmp_path, ""))
    assert r == recipes.Recipe()
    assert r.model.name == "gpt" and r.data.name == "synthetic" and r.strategy.name == "ddp"
    assert r.training.steps == 100 and r.training.precision == "fp32" and r.world.nproc == 2
    assert r.checkpoint.resume == "auto" and r.output.dir is None


def test_file_values_override_defaults_and_the_rest_stay(tmp_path):
    r = recipes.load(write(tmp_path, "training:\n  steps: 7\n  precision: bf16\nstrategy:\n  name: zero2\n"))
    assert r.training.steps == 7 and r.training.precision == "bf16" and r.strategy.name == "zero2"
    assert r.training.micro_batch == recipes.TrainingConfig().micro_batch
    assert r.model == recipes.ModelConfig()


def test_command_line_beats_file_beats_defaults(tmp_path):
    path = write(tmp_path, "training:\n  steps: 7\n  seed: 3\n")
    r = recipes.load(path, ["training.steps=9"])
    assert r.training.steps == 9  # CLI over file
    assert r.training.seed == 3  # file over default
    assert r.training.grad_accum == 1  # default
    # the last of two overrides of one key wins
    assert recipes.load(path, ["training.steps=9", "training.steps=11"]).training.steps == 11


def test_override_values_are_yaml_typed(tmp_path):
    path = write(tmp_path, "")
    r = recipes.load(path, ["training.steps=50", "optimizer.lr=3e-4", "strategy.reshard_after_forward=false",
                            "optimizer.betas=[0.8, 0.9]", "comm.regroup_at=[2, 5]", "model.kwargs={a: 1}",
                            "model.target=pkg.mod:fn", "output.dir=/tmp/some where"])
    assert r.training.steps == 50 and isinstance(r.training.steps, int)
    assert r.optimizer.lr == pytest.approx(3e-4)
    assert r.strategy.reshard_after_forward is False
    assert r.optimizer.betas == (0.8, 0.9)
    assert r.comm.regroup_at == [2, 5]
    assert r.model.kwargs == {"a": 1}
    assert r.model.target == "pkg.mod:fn"
    assert r.output.dir == "/tmp/some where"


def test_override_can_create_a_section_missing_from_the_file(tmp_path):
    r = recipes.load(write(tmp_path, "model:\n  name: gpt\n"), ["checkpoint.every=5"])
    assert r.checkpoint.every == 5


def test_loading_does_not_change_the_tree_it_is_given():
    tree = {"training": {"steps": 3}}
    recipes.build(tree, ["training.steps=4", "model.layers=3"])
    assert tree == {"training": {"steps": 3}}


def test_resolved_recipe_round_trips_through_dump_and_load(tmp_path):
    text_file = write(tmp_path, "to be or not to be, that is the question\n" * 10, "t.txt")
    r = recipes.load(write(tmp_path, "model:\n  name: gpt\n  width: 48\n  heads: 3\n"),
                     ["data.name=text", f"data.path={text_file}", "strategy.name=fsdp", "training.precision=bf16",
                      "optimizer.betas=[0.8, 0.99]", "comm.regroup_at=[3]", "training.steps=10", "output.dir=x/y"])
    dumped = recipes.dump(r)
    again = recipes.load(write(tmp_path, dumped, "resolved.yaml"))
    assert again == r
    assert recipes.dump(again) == dumped


def test_shipped_recipes_round_trip(tmp_path):
    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "recipes").glob("*.yaml")):
        tree = recipes.read_file(path)
        if tree.get("data", {}).get("path"):  # data.path is relative to the repository root
            tree["data"]["path"] = str(root / tree["data"]["path"])
        r = recipes.build(tree)
        assert recipes.load(write(tmp_path, recipes.dump(r), path.name)) == r, path


def test_unknown_key_names_the_field_and_the_accepted_keys(tmp_path):
    lines = errors_of(write(tmp_path, "training:\n  stepz: 5\n"))
    assert len(lines) == 1
    assert lines[0].startswith("training.stepz: unknown key")
    assert "steps" in lines[0] and "micro_batch" in lines[0]


def test_unknown_section(tmp_path):
    lines = errors_of(write(tmp_path, "trainer:\n  steps: 5\n"))
    assert lines[0].startswith("trainer: unknown key") and "training" in lines[0]


def test_bad_literal_names_the_accepted_choices(tmp_path):
    (line,) = errors_of(write(tmp_path, ""), ["strategy.name=zero4"])
    assert line.startswith("strategy.name:") and "'zero4'" in line
    for choice in ("ddp", "fsdp", "zero1", "zero2", "zero3"):
        assert choice in line


def test_all_errors_are_reported_at_once(tmp_path):
    path = write(tmp_path, "training:\n  steps: 0\n  precision: fp16\n  bogus: 1\nmodel:\n  width: abc\n")
    lines = errors_of(path, ["strategy.name=zero4", "optimizer.lr=-1"])
    fields = [line.split(":")[0] for line in lines]
    assert sorted(fields) == sorted(["training.steps", "training.precision", "training.bogus", "model.width",
                                     "strategy.name", "optimizer.lr"]), lines
    assert any("'fp16'" in line for line in lines)
    assert any("'abc'" in line for line in lines)


def test_cross_field_errors_are_reported_at_once(tmp_path):
    lines = errors_of(write(tmp_path, ""), ["data.name=text", "model.width=30", "model.heads=4",
                                           "resilience.mode=inplace", "strategy.name=fsdp", "world.nproc=3",
                                           "resilience.parity_group=2"])
    fields = sorted(line.split(":")[0] for line in lines)
    assert fields == ["data.path", "model.heads", "resilience.parity_group"], lines


@pytest.mark.parametrize("overrides, field, bad", [
    (["training.steps=-3"], "training.steps", "-3"),
    (["optimizer.lr=0"], "optimizer.lr", "0"),
    (["training.micro_batch=many"], "training.micro_batch", "'many'"),
    (["world.nproc=[2]"], "world.nproc", "[2]"),
    (["training.precision=fp16"], "training.precision", "'fp16'"),
    (["strategy.bucket_mb=0"], "strategy.bucket_mb", "0"),
    (["model.dropout=1.5"], "model.dropout", "1.5"),
    (["model.name=gpt", "data.name=digits"], "model.name", "'gpt'"),
    (["model.name=mlp", "data.name=synthetic"], "model.name", "'mlp'"),
    (["model.width=10", "model.heads=4"], "model.heads", "4"),
    (["model.target=no_colon"], "model.target", "'no_colon'"),
    (["data.name=text", "data.path=/no/such/file.txt"], "data.path", "'/no/such/file.txt'"),
    (["comm.regroup_at=[0, 200]", "training.steps=100"], "comm.regroup_at", "[0, 200]"),
])
def test_each_bad_value_is_named(tmp_path, overrides, field, bad):
    lines = errors_of(write(tmp_path, ""), overrides)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{field}:") and bad in lines[0], lines


def test_model_dtype_points_to_training_precision(tmp_path):
    # where a user looks for the weights' dtype: one line naming the key that sets it and its values
    (line,) = errors_of(write(tmp_path, "model:\n  dtype: bf16\n"))
    assert line.startswith("model.dtype:") and "training.precision" in line and "fp32, bf16" in line, line


@pytest.mark.parametrize("item", ["training.steps", "=5", ".steps=5", "training..steps=5", "training.=5"])
def test_bad_override_syntax(tmp_path, item):
    (line,) = errors_of(write(tmp_path, ""), [item])
    assert line.startswith("override:") and repr(item) in line


def test_override_into_a_value(tmp_path):
    # the file sets the value: the override is refused before validation
    (line,) = errors_of(write(tmp_path, "training:\n  steps: 5\n"), ["training.steps.x=1"])
    assert line.startswith("training.steps:") and "'training.steps.x'" in line
    # the value is a default: validation refuses the section it became
    (line,) = errors_of(write(tmp_path, ""), ["training.steps.x=1"])
    assert line.startswith("training.steps:") and "{'x': 1}" in line


def test_missing_file(tmp_path):
    (line,) = errors_of(tmp_path / "nope.yaml")
    assert line.startswith("recipe:") and "nope.yaml" in line and "no such file" in line


def test_invalid_yaml_names_the_line(tmp_path):
    (line,) = errors_of(write(tmp_path, "model:\n  name: gpt\n  width: [1, 2\n"))
    assert line.startswith("recipe:") and "not valid YAML" in line and "line" in line


def test_top_level_must_be_a_mapping(tmp_path):
    (line,) = errors_of(write(tmp_path, "- model\n- data\n"))
    assert line.startswith("recipe:") and "list" in line and "mapping" in line


def test_section_that_is_not_a_mapping(tmp_path):
    (line,) = errors_of(write(tmp_path, "training: 5\n"))
    assert line.startswith("training:") and "5" in line
