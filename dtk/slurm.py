"""Slurm: under `srun` (one `dtk train` per node), the run's nodes, this node's rank and the rendezvous endpoint come
from the SLURM_* variables. A pure function of the environment, so it is tested without Slurm."""
from __future__ import annotations

import itertools
import re

from dtk.errors import DtkError

DEFAULT_PORT = 29500
"""The rendezvous port on the first node when neither DTK_RDZV_PORT nor MASTER_PORT is set (torchrun's default)."""
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names: `node[01-04,07]`, `a1,b[2-3]`, `rack[1-2]-n[1-2]`."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)  # literal text and [ranges] alternate
        choices = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1], text))
            elif part:
                choices.append([part])
        hosts += ["".join(c) for c in itertools.product(*choices)]
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise DtkError(f"SLURM_JOB_NODELIST: got {text!r}; accepted: a Slurm host list like node[01-04,07]")
    return [x for x in out + [cur] if x]


def _expand_ranges(inner: str, whole: str) -> list[str]:
    out = []
    for r in inner.split(","):
        m = _RANGE.match(r.strip())
        if not m:
            raise DtkError(f"SLURM_JOB_NODELIST: got {whole!r}; accepted: a Slurm host list like node[01-04,07]")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]  # node[01-10]: keeps the zero padding
    return out


def under_srun(env: dict[str, str]) -> bool:
    """A Slurm job step started by srun (the batch script itself has the job's variables but no step)."""
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env and "SLURM_NODEID" in env


def launch_plan(env: dict[str, str]) -> dict | None:
    """nnodes, node_rank and rdzv_endpoint (dtk.rendezvous.Topology's fields) from Slurm's variables, or None when
    this is not an srun step. The step's values (SLURM_STEP_*) win over the job's: a step may use fewer nodes.
    The endpoint is MASTER_ADDR, else the step's first node, at DTK_RDZV_PORT, else MASTER_PORT, else 29500."""
    if not under_srun(env):
        return None
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_rank = _int(env, "SLURM_NODEID")
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if tasks is not None and tasks.isdigit() and int(tasks) != nnodes:
        raise DtkError(f"SLURM_STEP_NUM_TASKS: got {tasks} tasks on {nnodes} nodes; accepted: one `dtk train` per "
                       f"node (srun --ntasks-per-node=1); dtk starts world.nproc ranks on each node itself")
    if not 0 <= node_rank < nnodes:
        raise DtkError(f"SLURM_NODEID: got {node_rank}; accepted: 0..{nnodes - 1} (the step has {nnodes} nodes)")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    host = env.get("MASTER_ADDR")
    if not host:
        if not nodelist:
            raise DtkError("SLURM_JOB_NODELIST: not set; accepted: a Slurm host list, or MASTER_ADDR=host")
        host = expand_nodelist(nodelist)[0]
    port_text = env.get("DTK_RDZV_PORT") or env.get("MASTER_PORT") or str(DEFAULT_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        name = "DTK_RDZV_PORT" if env.get("DTK_RDZV_PORT") else "MASTER_PORT"
        raise DtkError(f"{name}: got {port_text!r}; accepted: a port in 1..65535")
    return {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": f"{host}:{int(port_text)}"}


def _int(env: dict[str, str], *names: str) -> int:
    for name in names:
        value = env.get(name)
        if value is None:
            continue
        if not value.isdigit():
            raise DtkError(f"{name}: got {value!r}; accepted: a whole number (as Slurm sets it)")
        return int(value)
    raise DtkError(f"{names[0]}: not set under srun; accepted: Slurm's own variables ({', '.join(names)})")
