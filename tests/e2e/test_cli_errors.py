"""User mistakes through the real CLI: exit code 2, one `error:` line per mistake naming the field and the bad
value, no traceback, nothing written."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RECIPES, run_dtk

pytestmark = pytest.mark.e2e

QUICKSTART = RECIPES / "quickstart.yaml"

# (id, recipe, arguments after the recipe, what every error line together must mention: field, bad value)
# A recipe of None is written per case from FILES; "{missing}" is a path that does not exist.
FILES = {
    "invalid_yaml": "model:\n  name: gpt\n  width: 64: 3\n",
    "top_level_list": "- model\n- data\n",
}
CASES = [
    ("unknown_key", QUICKSTART, ["training.stepz=5"], ["training.stepz", "unknown key"]),
    ("unknown_section", QUICKSTART, ["trainer.steps=5"], ["trainer", "unknown key"]),
    ("bad_strategy", QUICKSTART, ["strategy.name=zero4"], ["strategy.name", "'zero4'", "zero3"]),
    ("fp16", QUICKSTART, ["training.precision=fp16"], ["training.precision", "'fp16'", "bf16"]),
    ("negative_steps", QUICKSTART, ["training.steps=-5"], ["training.steps", "-5"]),
    ("zero_lr", QUICKSTART, ["optimizer.lr=0"], ["optimizer.lr", "0"]),
    ("zero_nproc", QUICKSTART, ["world.nproc=0"], ["world.nproc", "0"]),
    ("wrong_type", QUICKSTART, ["training.micro_batch=many"], ["training.micro_batch", "'many'"]),
    ("list_for_int", QUICKSTART, ["model.layers=[1, 2]"], ["model.layers", "[1, 2]"]),
    ("missing_recipe", "{missing}", [], ["recipe", "no-such-recipe.yaml", "no such file"]),
    ("invalid_yaml", "invalid_yaml", [], ["recipe", "invalid_yaml.yaml", "not valid YAML", "line 3"]),
    ("top_level_list", "top_level_list", [], ["recipe", "top_level_list.yaml", "list"]),
    ("override_without_value", QUICKSTART, ["training.steps"], ["override", "'training.steps'"]),
    ("override_without_key", QUICKSTART, ["=5"], ["override", "'=5'"]),
    ("override_into_value", QUICKSTART, ["training.steps.x=1"], ["training.steps", "'training.steps.x'"]),
    ("gpt_on_digits", QUICKSTART, ["data.name=digits"], ["model.name", "'gpt'", "digits"]),
    ("mlp_on_tokens", QUICKSTART, ["model.name=mlp"], ["model.name", "'mlp'", "synthetic"]),
    ("heads_not_dividing_width", QUICKSTART, ["model.width=128", "model.heads=3"], ["model.heads", "3", "128"]),
    ("text_without_path", QUICKSTART, ["data.name=text"], ["data.path", "missing"]),
    ("missing_text_file", QUICKSTART, ["data.name=text", "data.path=no/such/text.txt"],
     ["data.path", "'no/such/text.txt'", "no such file"]),
    ("bad_target", QUICKSTART, ["model.target=mymodels"], ["model.target", "'mymodels'"]),
    ("parity_groups_do_not_tile", QUICKSTART, ["resilience.mode=inplace", "strategy.name=fsdp", "world.nproc=3",
                                                "resilience.parity_group=2"],
     ["resilience.parity_group", "got 2", "accepted: 3"]),
    ("regroup_out_of_range", QUICKSTART, ["training.steps=10", "comm.regroup_at=[10]"], ["comm.regroup_at", "[10]"]),
    ("node_rank_too_big", QUICKSTART, ["--nnodes", "2", "--node-rank", "2"], ["--node-rank", "2", "0..1"]),
    ("zero_nnodes", QUICKSTART, ["--nnodes", "0"], ["--nnodes", "'0'"]),
    ("nnodes_not_a_number", QUICKSTART, ["--nnodes", "two"], ["--nnodes", "'two'"]),
    ("endpoint_without_port", QUICKSTART, ["--rdzv-endpoint", "node0"], ["--rdzv-endpoint", "'node0'"]),
    ("endpoint_bad_port", QUICKSTART, ["--rdzv-endpoint", "node0:99999"], ["--rdzv-endpoint", "'node0:99999'"]),
    ("unknown_option", QUICKSTART, ["--bogus"], ["--bogus"]),
    ("kill_host_on_one_host", QUICKSTART, ["--fault", "kill-host:host=0,step=3"],
     ["--fault", "'kill-host:host=0,step=3'", "more than one host"]),
    ("kill_host_out_of_range", QUICKSTART, ["--nnodes", "2", "--fault", "kill-host:host=2,step=3"],
     ["--fault", "host=2", "host=0..1"]),
    ("fault_past_the_last_step", QUICKSTART, ["training.steps=5", "--fault", "kill:rank=1,step=5"],
     ["--fault", "step=5", "step=0..4"]),
    ("recovery_phase_without_inplace", QUICKSTART, ["resilience.mode=checkpoint", "checkpoint.every=2", "--fault",
                                                    "kill:rank=1,step=3,phase=recovery"],
     ["--fault", "phase=recovery", "'checkpoint'", "resilience.mode=inplace"]),
    ("checkpoint_phase_off_a_boundary", QUICKSTART, ["checkpoint.every=4", "--fault",
                                                     "kill:rank=1,step=3,phase=checkpoint"],
     ["--fault", "step=3", "phase=checkpoint", "checkpoint.every is 4", "a multiple of 4"]),
    ("target_not_importable", QUICKSTART, ["model.target=nosuchpkg.mod:fn"],
     ["model.target", "'nosuchpkg.mod:fn'", "cannot import 'nosuchpkg.mod'"]),
    ("target_not_callable", QUICKSTART, ["model.target=os:sep"], ["model.target", "'os:sep'", "not a function"]),
    ("testbed_of_no_host", QUICKSTART, ["--testbed", "0"], ["--testbed", "got 0", "2..64"]),
    ("inplace_on_one_rank", QUICKSTART, ["world.nproc=1", "resilience.mode=inplace"],
     ["resilience.mode", "'inplace'", "1 rank", "resilience.mode=checkpoint"]),
]


def assert_user_error(p, mentions: list[str]) -> list[str]:
    assert p.returncode == 2, f"exit {p.returncode}\nstdout:{p.stdout}\nstderr:{p.stderr}"
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines, "no error message"
    assert all(line.startswith("error: ") for line in lines), p.stderr
    for text in mentions:
        assert text in p.stderr, f"{text!r} not in: {p.stderr}"
    return lines


@pytest.mark.parametrize("recipe, args, mentions", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_train_refuses_bad_recipe_or_flag(tmp_path, recipe, args, mentions):
    if recipe == "{missing}":
        recipe = tmp_path / "no-such-recipe.yaml"
    elif recipe in FILES:
        recipe = tmp_path / f"{recipe}.yaml"
        recipe.write_text(FILES[recipe.stem])
    run_dir = tmp_path / "run"
    p = run_dtk("train", recipe, f"output.dir={run_dir}", *args, "--no-progress", timeout=60)
    lines = assert_user_error(p, mentions)
    assert len(lines) == 1, p.stderr
    assert not run_dir.exists(), "a refused run must not write its run folder"


def test_chaos_and_test_bed_mistakes_of_the_other_commands(tmp_path):
    """The same refusals where a new user meets them: inject-failure (a fault past the last step never fires),
    validate (it says what train would refuse), probe and bench comm (a test bed of fewer than 2 hosts)."""
    run_dir = tmp_path / "run"
    p = run_dtk("inject-failure", QUICKSTART, "training.steps=5", f"output.dir={run_dir}", "--fault",
                "kill:rank=1,step=50", "--no-progress", timeout=60)
    assert len(assert_user_error(p, ["--fault", "step=50", "step=0..4"])) == 1 and not run_dir.exists()
    p = run_dtk("validate", QUICKSTART, "model.target=nosuchpkg.mod:fn", timeout=60)
    assert len(assert_user_error(p, ["model.target", "cannot import"])) == 1
    for command in (["probe", "--testbed", "1"], ["bench", "comm", "--testbed", "0"]):
        p = run_dtk(*command, timeout=60)
        assert len(assert_user_error(p, ["--testbed", f"got {command[-1]}", "2..64"])) == 1


def test_the_readmes_sample_error_is_what_dtk_prints():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = "$ dtk train recipes/quickstart.yaml strategy.name=zero4 training.steps=-1\n"
    sample = readme.split(command, 1)[1].split("```", 1)[0].strip()
    p = run_dtk("train", QUICKSTART, "strategy.name=zero4", "training.steps=-1", timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == sample


def test_train_reports_every_mistake_at_once(tmp_path):
    run_dir = tmp_path / "run"
    p = run_dtk("train", QUICKSTART, f"output.dir={run_dir}", "strategy.name=zero4", "training.precision=fp16",
                "training.steps=0", "optimizer.lr=-1", "--no-progress", timeout=60)
    lines = assert_user_error(p, ["strategy.name", "training.precision", "training.steps", "optimizer.lr"])
    assert len(lines) == 4, p.stderr
    assert not run_dir.exists()


def test_validate_reports_several_errors_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: gpt\n  width: 30\n  heads: 4\n  colour: blue\n"
                   "training:\n  steps: -1\n  precision: fp16\nstrategy:\n  name: zero4\n")
    p = run_dtk("validate", bad, timeout=60)
    lines = assert_user_error(p, ["model.colour", "training.steps", "training.precision", "strategy.name"])
    assert len(lines) >= 4, p.stderr
    assert p.stdout.strip() == "", "validate must not print a resolved recipe for a bad one"


def test_validate_reports_cross_field_errors_at_once(tmp_path):
    p = run_dtk("validate", QUICKSTART, "data.name=text", "model.heads=3", "resilience.mode=inplace",
                "strategy.name=zero2", "world.nproc=3", "resilience.parity_group=2", timeout=60)
    lines = assert_user_error(p, ["data.path", "model.heads", "resilience.parity_group"])
    assert len(lines) == 3, p.stderr


def test_validate_good_recipe_prints_the_resolved_recipe():
    p = run_dtk("validate", QUICKSTART, "training.steps=7", timeout=60)
    assert p.returncode == 0, p.stderr
    assert "steps: 7" in p.stdout and "ok" in p.stdout
