"""`dtk simulate productivity` and `dtk simulate congestion`: flags checked into models, the simulators run, shown."""
from __future__ import annotations

import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from dtk.errors import DtkError

simulate_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, context_settings={"max_content_width": 120}, help="Model clusters far larger than this machine: failures, congestion.")
out = Console(width=None if sys.stdout.isatty() else 140)


def _positive(value: float, flag: str, *, zero_ok: bool = False) -> float:
    if not (value >= 0 if zero_ok else value > 0):
        raise DtkError(f"{flag}: got {value:g}; accepted: a number {'>= 0' if zero_ok else '> 0'}")
    return value


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        gpus = []
    if not gpus or min(gpus) < 1:
        raise DtkError(f"--gpus: got {text!r}; accepted: a comma list of GPU counts >= 1, e.g. 1024,16384,131072")
    return gpus


def _interval(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DtkError(f"--checkpoint-every-s: got {text!r}; accepted: seconds > 0, or auto (Young/Daly)")
    return value


def _outputs(json_out: str | None, png: str | None) -> tuple[Path | None, Path | None]:
    """The JSON and PNG paths; the plot goes next to the JSON unless given."""
    json_path = Path(json_out) if json_out else None
    png_path = Path(png) if png else (json_path.with_suffix(".png") if json_path else None)
    if png_path is not None and png_path.suffix.lower() != ".png":
        raise DtkError(f"--png: got {str(png_path)!r}; accepted: a file name ending in .png")
    return json_path, png_path


def _command() -> str:
    return "dtk " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@simulate_app.command()
def productivity(
    gpus: Annotated[str, typer.Option(help="Comma list of job sizes in GPUs.")] = "1024,16384,131072,5000000",
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (a node fails as a whole).")] = 8,
    failures_per_1000_node_days: Annotated[float, typer.Option(help="Node failure rate (Kokolis et al.: 6.50 on RSC-1).")] = 6.5,
    days: Annotated[float, typer.Option(help="Length of the simulated period.")] = 30.0,
    method: Annotated[Optional[list[str]], typer.Option(help="checkpoint, inplace or replica; repeatable; default all.")] = None,
    checkpoint_every_s: Annotated[str, typer.Option(help="Work between checkpoints, seconds, or auto (Young/Daly).")] = "auto",
    checkpoint_save_s: Annotated[float, typer.Option(help="Blocking save time per checkpoint.")] = 30.0,
    restart_s: Annotated[float, typer.Option(help="checkpoint: detect + restart + load per failure, before redoing lost work.")] = 600.0,
    restart_per_doubling_s: Annotated[float, typer.Option(help="checkpoint: restart seconds added per doubling of the node count.")] = 0.0,
    recovery_s: Annotated[Optional[float], typer.Option(help="inplace: stall per failure, detect to the redone step; 5 s, an assumed figure, when neither this nor --calibrate is given.")] = None,
    protection_cost: Annotated[Optional[float], typer.Option(help="inplace: share of the throughput its in-memory protection takes, failure or not (0.1 = 10%); 0 when neither this nor --calibrate is given.")] = None,
    redo_s: Annotated[float, typer.Option(help="inplace: work redone per failure beyond the failed step, after a rollback to the last protection (about (protect_every - 1) / 2 step times).")] = 0.0,
    calibrate: Annotated[Optional[str], typer.Option(metavar="RUN_DIR", help="inplace: the median downtime of this run's in-place recoveries, and its protection cost (see --calibrate-baseline).")] = None,
    calibrate_baseline: Annotated[Optional[str], typer.Option(metavar="RUN_DIR", help="with --calibrate: the same recipe run without protection; the protection cost is then the throughput lost against it (else the run's parity stall time, a lower bound).")] = None,
    inplace_fallback: Annotated[float, typer.Option(help="inplace: fraction of failures it cannot repair; they cost a checkpoint restart (checkpoint flags), and the job then also saves checkpoints.")] = 0.0,
    replicas: Annotated[int, typer.Option(help="replica: data-parallel replica groups.")] = 12,
    replica_stall_s: Annotated[float, typer.Option(help="replica: full stall per failure.")] = 180.0,
    replica_rejoin_s: Annotated[float, typer.Option(help="replica: time the failed replica stays offline after the stall.")] = 420.0,
    target: Annotated[Optional[float], typer.Option(help="Also solve for the recovery time each method needs for this ratio, e.g. 0.9.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the failure times.")] = 0,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Write inputs and results here (and a PNG next to it).")] = None,
    png: Annotated[Optional[str], typer.Option(metavar="FILE", help="Write the plot here.")] = None,
) -> None:
    """Productive time ratio of a synchronous job under node failures, per recovery method and job size."""
    from dtk.sim import output
    from dtk.sim import productivity as prod

    sizes = _gpu_list(gpus)
    if gpus_per_node < 1:
        raise DtkError(f"--gpus-per-node: got {gpus_per_node}; accepted: an integer >= 1")
    _positive(failures_per_1000_node_days, "--failures-per-1000-node-days")
    _positive(days, "--days")
    names = list(dict.fromkeys(method or prod.METHODS))
    for name in names:
        if name not in prod.METHODS:
            raise DtkError(f"--method: got {name!r}; accepted: {', '.join(prod.METHODS)}")
    every = _interval(checkpoint_every_s)
    expected = max(sizes) / gpus_per_node * failures_per_1000_node_days / 1000 * days
    if expected > 1e7:  # each failure holds a few arrays of floats; more takes minutes and gigabytes
        raise DtkError(f"--gpus/--days: got {max(sizes):,} GPUs over {days:g} days, about {expected:,.0f} failures; "
                       f"accepted: up to 10,000,000 failures per simulation")
    for value, flag in ((checkpoint_save_s, "--checkpoint-save-s"), (restart_s, "--restart-s"),
                        (restart_per_doubling_s, "--restart-per-doubling-s"), (replica_stall_s, "--replica-stall-s"),
                        (replica_rejoin_s, "--replica-rejoin-s")):
        _positive(value, flag, zero_ok=True)
    if not 0 <= inplace_fallback <= 1:
        raise DtkError(f"--inplace-fallback: got {inplace_fallback:g}; accepted: a fraction from 0 to 1")
    if replicas < 2:
        raise DtkError(f"--replicas: got {replicas}; accepted: an integer >= 2")
    if target is not None and not 0 < target < 1:
        raise DtkError(f"--target: got {target:g}; accepted: a ratio between 0 and 1, e.g. 0.9")
    if recovery_s is not None and calibrate is not None:
        raise DtkError(f"--recovery-s and --calibrate: got both ({recovery_s:g}, {calibrate!r}); accepted: one of them")
    if protection_cost is not None and calibrate is not None:
        raise DtkError(f"--protection-cost and --calibrate: got both ({protection_cost:g}, {calibrate!r}); accepted: "
                       f"one of them")
    if calibrate_baseline is not None and calibrate is None:
        raise DtkError(f"--calibrate-baseline: got {calibrate_baseline!r} without --calibrate; accepted: both")
    if protection_cost is not None and not 0 <= protection_cost < 1:
        raise DtkError(f"--protection-cost: got {protection_cost:g}; accepted: a fraction from 0 to below 1")
    _positive(redo_s, "--redo-s", zero_ok=True)
    source = "--recovery-s" if recovery_s is not None else "assumed (not measured: give --recovery-s or --calibrate)"
    cost_source = "--protection-cost" if protection_cost is not None else "assumed free (give --protection-cost or --calibrate)"
    if calibrate is not None:
        from dtk.sim.calibrate import calibrate_inplace

        cal = calibrate_inplace(calibrate, baseline=calibrate_baseline)
        recovery_s, protection_cost, cost_source = cal.recovery_s, cal.protection_cost, cal.cost_source
        source = f"median downtime_s of {cal.recoveries} in-place recoveries in {calibrate}"
    recovery = _positive(recovery_s if recovery_s is not None else prod.InPlace().recovery_s, "--recovery-s", zero_ok=True)
    cost = protection_cost if protection_cost is not None else 0.0
    json_path, png_path = _outputs(json_out, png)

    checkpoint = prod.Checkpoint(every_s=every, save_s=checkpoint_save_s, restart_s=restart_s,
                                 restart_per_doubling_s=restart_per_doubling_s)
    inplace = prod.InPlace(recovery_s=recovery, protection_cost=cost, redo_s=redo_s, fallback=inplace_fallback,
                           checkpoint=checkpoint)
    built: dict[str, prod.Method] = {
        "checkpoint": checkpoint, "inplace": inplace,
        "replica": prod.Replica(replicas=replicas, stall_s=replica_stall_s, rejoin_s=replica_rejoin_s)}
    methods = {name: built[name] for name in names}
    rows = prod.study(gpus=sizes, methods=methods, gpus_per_node=gpus_per_node, days=days, seed=seed,
                      failures_per_1000_node_days=failures_per_1000_node_days, target=target)
    out.print(output.productivity_table(rows))
    if target is not None:
        out.print(output.needed_table(rows, target))
    crossover = None
    if "inplace" in methods:
        out.print(f"inplace recovery {recovery:.2f} s per failure: {source}", highlight=False)
        out.print(f"inplace protection cost {cost:.1%} of the throughput: {cost_source}", highlight=False)
        crossover = prod.crossover_gpus(inplace, checkpoint, gpus_per_node=gpus_per_node, days=days,
                                        failures_per_1000_node_days=failures_per_1000_node_days,
                                        up_to=max(max(sizes), 10_000_000))
        out.print(output.crossover_line(crossover, up_to=max(max(sizes), 10_000_000)), highlight=False)
    if json_path is not None:
        inputs = {"gpus": sizes, "gpus_per_node": gpus_per_node, "days": days, "seed": seed, "target": target,
                  "failures_per_1000_node_days": failures_per_1000_node_days, "inplace_recovery_source": source,
                  "inplace_protection_cost_source": cost_source, "inplace_overtakes_checkpoint_at_gpus": crossover,
                  "methods": {name: {"what": prod.METHODS[name], **asdict(m)} for name, m in methods.items()},
                  "command": _command()}
        output.write_json(json_path, {"inputs": inputs, "results": rows})
    if png_path is not None:
        output.productivity_png(png_path, rows, target=target, title=(
            f"{failures_per_1000_node_days:g} failures / 1000 node-days, {gpus_per_node} GPUs/node, {days:g} days; "
            f"inplace {recovery:.2f} s, protection {cost:.1%}"))
    written = [str(p) for p in (json_path, png_path) if p is not None]
    if written:
        out.print(f"written: {', '.join(written)}", highlight=False)


@simulate_app.command()
def congestion(
    topology: Annotated[str, typer.Option(help="star, fat-tree or rails.")] = "fat-tree",
    hosts: Annotated[int, typer.Option(help="Hosts in the collective, one rank each.")] = 32,
    link_gbps: Annotated[float, typer.Option(help="Each host link's (each NIC's, for rails) rate in Gbit/s.")] = 400.0,
    hosts_per_leaf: Annotated[int, typer.Option(help="fat-tree: hosts per leaf switch.")] = 8,
    spines: Annotated[int, typer.Option(help="fat-tree: spine switches.")] = 4,
    rails: Annotated[int, typer.Option(help="rails: NICs per host, one per rail.")] = 8,
    size: Annotated[str, typer.Option(help="All-reduce size, e.g. 256M.")] = "256M",
    alpha_us: Annotated[float, typer.Option(help="Per-message latency in microseconds.")] = 10.0,
    congested_links: Annotated[int, typer.Option(help="Links congested at random per draw.")] = 1,
    keep: Annotated[str, typer.Option(help="LOW,HIGH: a congested link keeps a uniform fraction in this range.")] = "0.05,0.5",
    trials: Annotated[int, typer.Option(help="Random draws.")] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the draws.")] = 0,
    testbed: Annotated[bool, typer.Option(help="Also predict the test bed's cases (`dtk bench comm --testbed`).")] = True,
    testbed_hosts: Annotated[int, typer.Option(help="Hosts on the test bed.")] = 4,
    testbed_link_gbps: Annotated[Optional[float], typer.Option(help="Unshaped test bed link as gloo sees it, Gbit/s; 4.77 (from FACTS.md) when not given.")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Write inputs and results here (and a PNG next to it).")] = None,
    png: Annotated[Optional[str], typer.Option(metavar="FILE", help="Write the gain distribution plot here.")] = None,
) -> None:
    """All-reduce algbw under random congested links: native ring vs an adaptive plan (reordered ring, leaf tree)."""
    from dtk.sizes import parse_size
    from dtk.sim import congestion as cg
    from dtk.sim import output

    if topology not in cg.TOPOLOGIES:
        raise DtkError(f"--topology: got {topology!r}; accepted: {', '.join(cg.TOPOLOGIES)}")
    for value, flag, least in ((hosts, "--hosts", 3), (hosts_per_leaf, "--hosts-per-leaf", 1),
                               (spines, "--spines", 1), (rails, "--rails", 1), (trials, "--trials", 1),
                               (testbed_hosts, "--testbed-hosts", 3)):
        if value < least:
            raise DtkError(f"{flag}: got {value}; accepted: an integer >= {least}")
    _positive(link_gbps, "--link-gbps")
    _positive(alpha_us, "--alpha-us", zero_ok=True)
    nbytes = parse_size(size, "--size")
    try:
        low, high = (float(x) for x in keep.split(","))
    except ValueError:
        low = high = -1.0
    if not 0 < low <= high <= 1:
        raise DtkError(f"--keep: got {keep!r}; accepted: LOW,HIGH with 0 < LOW <= HIGH <= 1, e.g. 0.05,0.5")
    net = cg.build(topology, hosts=hosts, host_bps=link_gbps * 1e9 / 8, hosts_per_leaf=hosts_per_leaf,
                   spines=spines, rails_per_host=rails)
    if not 1 <= congested_links <= len(net.capacity):
        raise DtkError(f"--congested-links: got {congested_links}; accepted: 1..{len(net.capacity)} (links in this topology)")
    json_path, png_path = _outputs(json_out, png)
    alpha_s = alpha_us * 1e-6
    rows = cg.sweep(net, size=nbytes, alpha_s=alpha_s, congested=congested_links, keep=(low, high), trials=trials,
                    seed=seed)
    out.print(output.congestion_table(rows))
    counts = output.plan_counts(rows)
    out.print("plans chosen: " + ", ".join(f"{k} {v}" for k, v in counts.items()), highlight=False)
    predictions = []
    if testbed:
        host_bps = testbed_link_gbps * 1e9 / 8 if testbed_link_gbps else cg.TESTBED_HOST_BPS
        predictions = cg.testbed_predictions(hosts=testbed_hosts, host_bps=host_bps)
        out.print(output.testbed_table(predictions))
    if json_path is not None:
        inputs = {"topology": topology, "hosts": hosts, "link_gbps": link_gbps, "hosts_per_leaf": hosts_per_leaf,
                  "spines": spines, "rails": rails, "size_bytes": nbytes, "alpha_us": alpha_us,
                  "congested_links": congested_links, "keep": [low, high], "trials": trials, "seed": seed,
                  "command": _command()}
        output.write_json(json_path, {"inputs": inputs, "plans_chosen": counts, "draws": rows,
                                      "testbed_predictions": predictions})
    if png_path is not None:
        output.congestion_png(png_path, rows, title=f"{topology}, {hosts} hosts, {link_gbps:g} Gbit/s, {size} "
                                                    f"all-reduce, {congested_links} link(s) at {low:g}-{high:g} of rate")
    written = [str(p) for p in (json_path, png_path) if p is not None]
    if written:
        out.print(f"written: {', '.join(written)}", highlight=False)
