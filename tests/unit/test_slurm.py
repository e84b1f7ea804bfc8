"""The launch plan under srun, from a set of SLURM_* variables (no Slurm needed): nodes, node rank, endpoint."""
from __future__ import annotations

import pytest

from dtk.errors import DtkError
from dtk.slurm import DEFAULT_PORT, expand_nodelist, launch_plan

# what srun --nodes=4 --ntasks-per-node=1 sets on the third node (a subset of the variables)
STEP = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_NNODES": "5", "SLURM_JOB_NUM_NODES": "5",
        "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "2", "SLURM_PROCID": "2",
        "SLURM_JOB_NODELIST": "gpu[01-04,07]", "SLURM_STEP_NODELIST": "gpu[02-04,07]"}


@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("single", ["single"]),
])
def test_nodelist_expands_like_slurm(text, hosts):
    assert expand_nodelist(text) == hosts


def test_step_variables_give_nodes_rank_and_first_node_of_the_step():
    assert launch_plan(STEP) == {"nnodes": 4, "node_rank": 2, "rdzv_endpoint": f"gpu02:{DEFAULT_PORT}"}


def test_job_variables_when_the_step_has_none_and_ports_from_the_environment():
    env = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP_") or k == "SLURM_STEP_ID"}
    env.update(SLURM_NTASKS="5", MASTER_PORT="6000")
    assert launch_plan(env) == {"nnodes": 5, "node_rank": 2, "rdzv_endpoint": "gpu01:6000"}
    env.update(DTK_RDZV_PORT="7000", MASTER_ADDR="head.ib")
    assert launch_plan(env)["rdzv_endpoint"] == "head.ib:7000"


def test_not_under_srun_means_no_plan():
    assert launch_plan({}) is None
    batch_script = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}  # sbatch's script, before any srun
    assert launch_plan(batch_script) is None


def test_more_than_one_task_per_node_is_refused_in_one_line():
    with pytest.raises(DtkError) as e:
        launch_plan({**STEP, "SLURM_STEP_NUM_TASKS": "8"})
    assert e.value.lines == ["SLURM_STEP_NUM_TASKS: got 8 tasks on 4 nodes; accepted: one `dtk train` per node "
                             "(srun --ntasks-per-node=1); dtk starts world.nproc ranks on each node itself"]


@pytest.mark.parametrize("change, starts", [
    ({"SLURM_STEP_NODELIST": "gpu[01-"}, "SLURM_JOB_NODELIST: got 'gpu[01-'"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT: got 'http'"),
    ({"SLURM_NODEID": "4"}, "SLURM_NODEID: got 4; accepted: 0..3"),
])
def test_bad_variables_name_the_variable_and_value(change, starts):
    with pytest.raises(DtkError) as e:
        launch_plan({**STEP, **change})
    assert len(e.value.lines) == 1 and e.value.lines[0].startswith(starts)
