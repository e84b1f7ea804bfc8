"""The `dtk` command line: train, validate, compare, inject-failure, bench, and the registries' listings.

User mistakes print one `error:` line each and exit 2; a failed run exits 1; bugs keep their traceback.
"""
from __future__ import annotations

import shutil
import sys
from typing import Annotated, Any, Optional, overload

import typer
from rich.console import Console
from rich.table import Table

from dtk import recipe as recipes
from dtk.errors import RUN_FAILED_EXIT, USER_ERROR_EXIT, DtkError
from dtk.sim.commands import simulate_app

# Help in click's plain layout, wrapped at up to 120 columns: rich's boxed tables cut long option help with an
# ellipsis when the terminal (or a pipe, 80) is narrow, and the fault grammar was lost that way.
HELP: dict[str, Any] = {"rich_markup_mode": None, "context_settings": {"max_content_width": 120, "terminal_width": max(
    100, shutil.get_terminal_size().columns)}}


def _version(value: bool) -> None:
    if value:
        from dtk import __version__

        print(f"dtk {__version__}")
        raise typer.Exit(0)


app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, **HELP,
                  help="dtk: one recipe, trained under DDP, FSDP or DeepSpeed ZeRO, with resilience and comm layers.")
bench_app = typer.Typer(no_args_is_help=True, help="Measure dtk against its peers.", **HELP)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print dtk's version and exit.")] = False) -> None:
    pass
app.add_typer(bench_app, name="bench")
app.add_typer(simulate_app, name="simulate")
# wide enough for the report tables when output goes to a file or a pipe
out = Console(width=None if sys.stdout.isatty() else 140)

RecipeArg = Annotated[str, typer.Argument(help="The recipe YAML file.")]
OverridesArg = Annotated[Optional[list[str]], typer.Argument(help="Overrides as key.path=value, e.g. training.steps=50.")]


def _testbed_hosts(value: int | None) -> int:
    """--testbed H: 0 when it is left out; a test bed of fewer than 2 hosts is not one."""
    if value is None:
        return 0
    if value < 2:
        raise DtkError(f"--testbed: got {value}; accepted: 2..64 hosts (leave it out to run on this host's own "
                       "network)")
    return value


@overload
def _parse_endpoint(value: str) -> str: ...


@overload
def _parse_endpoint(value: None) -> None: ...


def _parse_endpoint(value: str | None) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DtkError(f"--rdzv-endpoint: got {value!r}; accepted: host:port with a port in 1..65535")
    return value


def _prestart(r: recipes.Recipe):
    """This node's ranks, started importing before this process imports torch (dtk.prestart)."""
    from dtk.prestart import Prestarted

    return Prestarted(r.world.nproc, threads_per_rank=r.world.threads_per_rank, device=r.world.device,
                      deepspeed=r.strategy.name.startswith("zero"))


@app.command()
def train(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nnodes: Annotated[Optional[int], typer.Option(min=1, help="Number of nodes (torchrun spelling); under srun: "
                                                              "SLURM_STEP_NUM_NODES.")] = None,
    node_rank: Annotated[Optional[int], typer.Option(min=0, help="This node's index, 0..nnodes-1; under srun: "
                                                                 "SLURM_NODEID.")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="host:port of node 0's store; default loopback; under "
                                                              "srun: the first node, port DTK_RDZV_PORT, MASTER_PORT "
                                                              "or 29500.")] = None,
    progress: Annotated[bool, typer.Option(help="Show the live progress line.")] = True,
    testbed: Annotated[Optional[int], typer.Option(max=64, help="Run on an emulated network of H hosts, 2..64 "
                                                                "(root): world.nproc ranks and one launcher on each.")] = None,
    fault: Annotated[Optional[list[str]], typer.Option(
        help="Inject a fault: KIND:rank=R,step=S, or on a test bed congest:pair=I-J,rate=R,step=S; repeatable.")] = None,
    live_control: Annotated[bool, typer.Option(hidden=True, help="Serve `dtk inject-failure --run` (node 0).")] = True,
) -> None:
    """Train a recipe: start the ranks, show progress, leave a run folder."""
    r = recipes.load(recipe, overrides or [])
    import os

    from dtk import netif, slurm

    given = (nnodes, node_rank, rdzv_endpoint)  # explicit flags win over Slurm's variables
    plan = (slurm.launch_plan(dict(os.environ)) or {}) if None in given else {}
    nnodes = nnodes if nnodes is not None else plan.get("nnodes", 1)
    node_rank = node_rank if node_rank is not None else plan.get("node_rank", 0)
    rdzv_endpoint = rdzv_endpoint if rdzv_endpoint is not None else plan.get("rdzv_endpoint")
    netif.check_name(r.world.interface)
    if node_rank >= nnodes:
        raise DtkError(f"--node-rank: got {node_rank}; accepted: 0..{nnodes - 1} (--nnodes is {nnodes})")
    endpoint = _parse_endpoint(rdzv_endpoint)
    testbed = _testbed_hosts(testbed)
    if testbed and (nnodes != 1 or endpoint):
        raise DtkError(f"--testbed: got {testbed} with --nnodes/--rdzv-endpoint; accepted: 2..64 hosts, alone (the "
                       "test bed sets nodes, node ranks and the endpoint)")
    if testbed:
        from dtk.testbed.net import check_environment

        check_environment()
    # the ranks start importing now, while this process imports torch (a test bed's launchers start their own)
    ranks = None if testbed else _prestart(r)
    try:
        from dtk.resilience import faults as fl

        world = r.world.nproc * (testbed or nnodes)
        parsed = [fl.parse(spec, world=world, fault_id=f"f{i}", hosts=testbed or None, nodes=testbed or nnodes)
                  for i, spec in enumerate(fault or [])]
        fl.check_reachable(parsed, steps=r.training.steps, mode=r.resilience.mode, every=r.checkpoint.every)
        fl.arm_checksums(r.resilience, faults=parsed)
        from dtk.launch import run_here
        from dtk.rendezvous import Topology

        topo = Topology(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=endpoint)
        code, run_dir = run_here(r, recipe_path=recipe, testbed=testbed, topology=topo, show_progress=progress,
                                 inject=parsed, live_control=live_control, prestarted=ranks)
    finally:
        if ranks is not None:
            ranks.close()
    if node_rank:  # node 0 prints the run's result; another node says how its own part ended
        state = {0: "done", 130: "interrupted", 143: "interrupted (SIGTERM)"}.get(code, "failed")
        out.print(f"node {node_rank}: {state}; its summary: {run_dir / f'summary-node{node_rank}.json'} "
                  f"(node 0 writes the run's summary.json)", highlight=False)
    elif not testbed:  # on a test bed, node 0's launcher printed it (its emulated host's `dtk train`)
        _print_run_result(run_dir, code)
    raise typer.Exit(code)


def _print_run_result(run_dir, code: int) -> None:
    import json

    from dtk.report import human_bytes
    from dtk.resilience.failures import FailureRecord

    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):  # not written (a full disk: the launcher said so)
        out.print(f"[red]failed[/]: run folder {run_dir}", highlight=False)
        return
    if code == 0:
        out.print(f"[green]done[/]: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
                  f"{summary['throughput']:,.0f} {summary['throughput_unit']}, "
                  f"p50 step {summary['step_time_p50'] * 1000:.0f} ms, "
                  f"peak {human_bytes(summary['peak_memory_bytes'])}, "
                  f"comm {human_bytes(summary['comm']['bytes_per_step'])}/step"
                  + (f", eval loss {summary['eval_loss']:.4f}" if summary.get("eval_loss") is not None else "")
                  + f"; run folder {run_dir}")
        for f in map(FailureRecord.from_dict, summary["failures"]):
            out.print(f"  recovered: rank {f.rank} ({f.fault}) at step {f.step}, "
                      f"downtime {_fmt(f.figures and f.figures.downtime_s)}s, {f.steps_lost or 0} steps lost",
                      highlight=False)
    elif code in (130, 143):  # Ctrl-C; SIGTERM (Slurm, Kubernetes), after the ranks saved the step they were at
        from dtk.resilience import checkpoint

        found = checkpoint.latest(run_dir)
        resume = (f"resumable from the checkpoint of step {found[0]}: run the same command with "
                  f"output.dir={run_dir}" if found else "not resumable: no checkpoint was saved (set checkpoint.every)")
        by = " (SIGTERM)" if code == 143 else ""
        out.print(f"[yellow]interrupted{by}[/] at step {summary['steps']}; {resume}", highlight=False)
    else:
        out.print(f"[red]failed[/]: run folder {run_dir}", highlight=False)


@app.command()
def validate(recipe: RecipeArg, overrides: OverridesArg = None,
             nnodes: Annotated[int, typer.Option(min=1, help="Check it for a run on this many nodes, as `dtk train "
                                                             "--nnodes` would.")] = 1) -> None:
    """Check a recipe (and overrides) without running it, as `dtk train` would before starting a rank (its model
    imports, in-place recovery has a survivor); print the resolved recipe."""
    r = recipes.load(recipe, overrides or [])
    recipes.check_launch(r, nnodes=nnodes)
    out.print(recipes.dump(r), end="", highlight=False)
    out.print(f"[green]ok[/]: {recipe}")


def _listing(title: str, rows: dict[str, str]) -> None:
    table = Table(title=title)
    table.add_column("name")
    table.add_column("what it is")
    for name, desc in rows.items():
        table.add_row(name, desc)
    out.print(table)


@app.command()
def strategies() -> None:
    """List the strategies (strategy.name)."""
    from dtk.strategies import STRATEGIES

    _listing("strategies", {k: v[1] for k, v in STRATEGIES.items()})


@app.command()
def models() -> None:
    """List the built-in models (model.name)."""
    from dtk.models import MODELS

    _listing("models", {k: v[1] for k, v in MODELS.items()})


@app.command()
def datasets() -> None:
    """List the data sets (data.name)."""
    from dtk.data import DATASETS

    _listing("data sets", DATASETS)


data_app = typer.Typer(no_args_is_help=True, help="Your own data: tokenize a corpus once into memory-mapped tokens.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    sources: Annotated[Optional[list[str]], typer.Argument(
        help="Text files (.txt, .md), .jsonl, .parquet, folders of them, or a datasets save_to_disk folder.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="The folder to write (new or empty): train.bin, val.bin, "
                                                             "meta.json, tokenizer/.")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="A local HF tokenizer folder (tokenizer.json, as "
                                                          "save_pretrained writes it).")] = None,
    train_tokenizer: Annotated[Optional[int], typer.Option(metavar="VOCAB", help="Train a byte-level BPE of this "
                                                           "vocabulary on the corpus instead (offline).")] = None,
    field: Annotated[str, typer.Option(help="The text field of .jsonl rows / column of .parquet and saved "
                                            "datasets.")] = "text",
    val_share: Annotated[float, typer.Option(help="Share of the tokens (the corpus's last) kept for validation; at "
                                                  "least one sequence.")] = 0.005,
    val: Annotated[Optional[list[str]], typer.Option(help="A given validation set instead of --val-share; "
                                                          "repeatable.")] = None,
    seq_len: Annotated[int, typer.Option(help="The context recorded in meta.json (data.seq_len's default).")] = 256,
    num_proc: Annotated[int, typer.Option(min=0, help="Tokenizer threads (and datasets' loading processes); 0 = "
                                                      "every core.")] = 0,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
) -> None:
    """Tokenize a corpus into DIR: train.bin / val.bin (uint16 or uint32), meta.json, the tokenizer; then train with
    data.name=tokens data.path=DIR."""
    if not out_dir:
        raise DtkError("--out: missing; accepted: --out DIR, a new or empty folder")
    from dtk.data.prepare import prepare, summary_line

    meta = prepare(sources=list(sources or []), out=out_dir, tokenizer=tokenizer, train_tokenizer=train_tokenizer,
                   field=field, val_share=val_share, val=list(val or []), seq_len=seq_len, num_proc=num_proc,
                   progress=progress)
    out.print(summary_line(meta, out_dir), highlight=False)


@app.command()
def export(
    run_dir: Annotated[str, typer.Argument(help="A run folder (the output.dir of a dtk train).")],
    out_dir: Annotated[str, typer.Option("--out", help="The folder to write (new or empty).")],
    step: Annotated[Optional[int], typer.Option(min=0, help="The checkpoint of this step; default: the run's final/ "
                                                           "model, else its newest checkpoint.")] = None,
    format: Annotated[str, typer.Option(help="safetensors (model.safetensors), hf (a save_pretrained folder, for "
                                             "model.hf) or torch (model.pt, a state dict).")] = "safetensors",
) -> None:
    """Turn a checkpoint of any strategy and rank count into one whole model, on this process (no ranks)."""
    from pathlib import Path

    from dtk import export as exporting

    if not exporting.is_format(format):
        raise DtkError(f"--format: got {format!r}; accepted: {', '.join(exporting.FORMATS)}")
    r, source = exporting.export(Path(run_dir), step=step, fmt=format, out=Path(out_dir))
    out.print(f"[green]exported[/] {source} ({r.strategy.name}) as {format} to {out_dir}", highlight=False)


@app.command()
def compare(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    strategies: Annotated[Optional[str], typer.Option(help="Comma list of strategy.name values, e.g. ddp,fsdp,zero3.")] = None,
    variant: Annotated[Optional[list[str]], typer.Option(help="NAME:key=value,key=value; repeatable.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="The compare folder; default runs/compare-<recipe>-<time>.")] = None,
    assert_parity: Annotated[Optional[float], typer.Option(min=0.0, metavar="TOL", help="Exit 1 when a variant's loss differs from the first's by more than TOL (relative) at any step.")] = None,
    progress: Annotated[bool, typer.Option(help="Show each run's progress line.")] = True,
    fault: Annotated[Optional[list[str]], typer.Option(
        help="Inject this fault into every variant (the same schedule for each): KIND:rank=R,step=S; repeatable.")] = None,
    testbed: Annotated[Optional[int], typer.Option(max=64, help="Run each variant on an emulated network of H "
                                                                "hosts, 2..64 (root; world.nproc ranks per host); "
                                                                "--fault congest:...")] = None,
    mtbf: Annotated[Optional[str], typer.Option(help="Also inject faults at random, this mean time apart (e.g. 30s): "
                                                     "the same schedule (seconds after start, rank) for every variant.")] = None,
    mtbf_fault: Annotated[str, typer.Option(help="The kind of the random faults.")] = "kill",
    seed: Annotated[int, typer.Option(help="Seed of the random faults (which rank, when).")] = 0,
) -> None:
    """Run a recipe under several strategies or overrides, one after another; table + compare.json/.md/.png."""
    import shlex

    from dtk import compare as cmp
    from dtk.resilience import faults as fl

    variants = cmp.resolve(recipe, overrides or [], strategies=strategies, variant_flags=variant or [])
    testbed = _testbed_hosts(testbed)
    built: list[recipes.Recipe] = []
    for v in variants:  # before the first variant runs, not when its turn comes
        assert v.recipe is not None  # resolve builds every variant's recipe
        recipes.check_launch(v.recipe, nnodes=max(testbed, 1))
        built.append(v.recipe)
    if testbed:
        from dtk.testbed.net import check_environment

        check_environment()
    injected = [fl.parse(spec, world=min(r.world.nproc for r in built) * max(testbed, 1), fault_id=f"f{i}",
                         hosts=testbed or None) for i, spec in enumerate(fault or [])]
    for r in built:  # steps are shared by every variant, resilience.mode need not be
        fl.check_reachable(injected, steps=r.training.steps, mode=r.resilience.mode, every=r.checkpoint.every)
    one_rank = [k for k in fl.FAULTS if k not in ("congest", "kill-host")]
    if mtbf and testbed:
        raise DtkError(f"--mtbf: got {mtbf!r} with --testbed {testbed}; accepted: --mtbf on local ranks only")
    if mtbf_fault not in one_rank:
        raise DtkError(f"--mtbf-fault: got {mtbf_fault!r}; accepted: {', '.join(one_rank)}")
    schedule = fl.random_schedule(mtbf_s=fl.parse_duration(mtbf, "--mtbf"), seed=seed,
                                  world=min(r.world.nproc for r in built)) if mtbf else []
    folder = cmp.prepare_out_dir(out_dir, recipe)
    command = "dtk " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = cmp.run(recipe_path=recipe, variants=variants, out_dir=folder, command=command, console=out,
                     parity_tolerance=assert_parity, show_progress=progress, inject=injected, testbed=testbed,
                     fault_schedule=schedule, schedule_kind=mtbf_fault)
    cmp.write(result)
    out.print(cmp.table(result))
    out.print(cmp.verdict_line(result), highlight=False)
    out.print(f"written: {folder / 'compare.json'}, compare.md, compare.png", highlight=False)
    code = 0 if len(result.done) == len(result.variants) else RUN_FAILED_EXIT
    for worse in result.parity_failures():
        out.print(f"[red]parity broken[/]: {worse['variant']} differs from {result.variants[0]['variant']} by "
                  f"{worse['max_rel_loss_diff']:.2e} (relative) at worst; --assert-parity {assert_parity:g}",
                  highlight=False)
        code = RUN_FAILED_EXIT
    raise typer.Exit(code)


@app.command("inject-failure")
def inject_failure(
    args: Annotated[Optional[list[str]], typer.Argument(
        help="RECIPE [key=value ...] to start a run with faults; with --run: the fault specs.")] = None,
    fault: Annotated[Optional[list[str]], typer.Option(
        help="KIND:rank=R,step=S[,phase=forward|backward|optimizer|commit|recovery|eval|checkpoint][,factor=F]"
             "[,seconds=T]; repeatable. `dtk faults` lists kinds.")] = None,
    run: Annotated[Optional[str], typer.Option(help="Aim the faults at this run folder's live run instead.")] = None,
    mtbf: Annotated[Optional[str], typer.Option(help="Also inject faults at random, this mean time apart (e.g. 30s).")] = None,
    mtbf_fault: Annotated[str, typer.Option(help="The kind of the random faults.")] = "kill",
    seed: Annotated[int, typer.Option(help="Seed of the random faults (which rank, when).")] = 0,
    progress: Annotated[bool, typer.Option(help="Show the live progress line.")] = True,
) -> None:
    """Break a run on purpose and report what recovery cost (detect, downtime and its breakdown, steps lost)."""
    args, specs = list(args or []), list(fault or [])
    if run is not None:
        from dtk.resilience import faults as fl
        from dtk.resilience.live import send_faults

        if not args + specs:
            raise DtkError("fault: none given; accepted: KIND:rank=R[,step=S] (e.g. kill:rank=1)")
        for spec in args + specs:  # check here first, so a typo is one clear line
            fl.parse(spec, world=1 << 16, fault_id="check", flag="fault", hosts=1 << 16)  # the run checks hosts
        for line in send_faults(run, args + specs):
            out.print(f"scheduled: {line} on the run in {run}", highlight=False)
        return
    if not args:
        raise DtkError("recipe: missing; accepted: dtk inject-failure RECIPE [key=value ...] --fault KIND:rank=R,step=S")
    recipe_path, overrides = args[0], args[1:]
    r = recipes.load(recipe_path, overrides)
    ranks = _prestart(r)
    try:
        _inject_and_run(r, recipe_path, specs, mtbf=mtbf, mtbf_fault=mtbf_fault, seed=seed, progress=progress,
                        prestarted=ranks)
    finally:
        ranks.close()


def _inject_and_run(r: recipes.Recipe, recipe_path: str, specs: list[str], *, mtbf: str | None, mtbf_fault: str,
                    seed: int, progress: bool, prestarted) -> None:
    from dtk.launch import launch
    from dtk.resilience import faults as fl

    world = r.world.nproc
    parsed = [fl.parse(spec, world=world, fault_id=f"f{i}") for i, spec in enumerate(specs)]
    fl.check_reachable(parsed, steps=r.training.steps, mode=r.resilience.mode, every=r.checkpoint.every)
    one_rank = [k for k in fl.FAULTS if k not in ("congest", "kill-host")]  # those two need several hosts
    if mtbf_fault not in one_rank:
        raise DtkError(f"--mtbf-fault: got {mtbf_fault!r}; accepted: {', '.join(one_rank)}")
    schedule = fl.random_schedule(mtbf_s=fl.parse_duration(mtbf, "--mtbf"), seed=seed, world=world) if mtbf else []
    if not parsed and not schedule:
        raise DtkError("--fault: none given; accepted: --fault KIND:rank=R,step=S (repeatable) or --mtbf 30s")
    fl.arm_checksums(r.resilience, faults=parsed, random_kind=mtbf_fault)
    code, run_dir = launch(r, recipe_path=recipe_path, show_progress=progress, inject=parsed,
                           fault_schedule=schedule, schedule_kind=mtbf_fault, prestarted=prestarted)
    _print_recovery_report(run_dir)
    _print_run_result(run_dir, code)
    _print_unfired(run_dir, parsed, mtbf=mtbf)
    raise typer.Exit(code)


def _print_unfired(run_dir, parsed: list, *, mtbf: str | None) -> None:
    """A chaos run whose faults did not fire tested nothing: say so, beside the result."""
    import json

    fired = set(json.loads((run_dir / "summary.json").read_text()).get("faults_fired", []))
    for f in parsed:
        if f.id not in fired:
            out.print(f"[yellow]not fired[/]: {f.spec()} (the run ended before it came due)", highlight=False)
    if mtbf and not any(i.startswith("mtbf") for i in fired):
        out.print(f"[yellow]--mtbf {mtbf}: no random fault fired[/]: every one came due outside training (before the "
                  f"ranks started, during a recovery, or after the last step); nothing was tested", highlight=False)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _print_recovery_report(run_dir) -> None:
    import json

    from dtk.resilience.failures import FailureRecord, Figures

    summary = json.loads((run_dir / "summary.json").read_text())
    records = [FailureRecord.from_dict(f) for f in summary["failures"]]
    figures = [f.figures or Figures(detect_s=None, downtime_s=None) for f in records]
    table = Table(title="recovery report")
    for col in ("fault", "rank", "step", "recovery", "replaced by", "detect s", "downtime s", "steps lost"):
        table.add_column(col, no_wrap=True)
    stages = sorted({k for c in figures for k in c.breakdown_s or {}},
                    key=lambda k: list(STAGE_ORDER).index(k) if k in STAGE_ORDER else 99)
    for f, cost in zip(records, figures):
        by = [x for x in (f.in_place.replacements if f.in_place else []) if x["rank"] == f.rank]
        table.add_row(f.fault, str(f.rank), str(f.step), f.recovery,
                      by[-1]["replacement"] + (f" {by[-1]['shadow']}" if "shadow" in by[-1] else "") if by else "-",
                      _fmt(cost.detect_s), _fmt(cost.downtime_s), "-" if f.steps_lost is None else str(f.steps_lost))
    downtimes = [c.downtime_s for c in figures if c.downtime_s is not None]
    lost = sum(f.steps_lost or 0 for f in records)
    table.add_row("total", "", "", "", "", "", _fmt(sum(downtimes)) if downtimes else "-", str(lost))
    out.print(table)
    if stages:
        parts = Table(title="downtime breakdown (s)")
        parts.add_column("fault")
        for k in stages:
            parts.add_column(k.replace("_", " "), no_wrap=True)
        for f, cost in zip(records, figures):
            b = cost.breakdown_s or {}
            parts.add_row(f"{f.fault}@{f.step}", *(_fmt(b.get(k)) for k in stages))
        out.print(parts)
    out.print(f"productive time ratio: {summary['productive_time_ratio']:.3f} "
              f"(useful step time / wall time {summary['wall_seconds']:.1f}s)", highlight=False)


STAGE_ORDER = ("detect", "stop", "release", "process_start", "import", "group_init", "engine_build",
               "checkpoint_load", "replay", "plan", "regroup", "state_transfer", "redo")


@app.command()
def faults() -> None:
    """List the faults `dtk inject-failure` can inject."""
    from dtk.resilience.faults import FAULTS

    _listing("faults", FAULTS)


@bench_app.command("comm")
def bench_comm(
    nproc: Annotated[int, typer.Option(min=2, max=16, help="Local ranks.")] = 2,
    ops: Annotated[str, typer.Option(help="Comma list of all_reduce, all_gather, reduce_scatter, reduce, broadcast "
                                          "(reduce and broadcast: each rank as root in turn).")] = "all_reduce,all_gather,reduce_scatter",
    min_bytes: Annotated[str, typer.Option(help="Smallest size, e.g. 4K.")] = "4K",
    max_bytes: Annotated[str, typer.Option(help="Largest size, e.g. 64M.")] = "64M",
    iters: Annotated[int, typer.Option(min=1)] = 5,
    warmup: Annotated[int, typer.Option(min=0)] = 2,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the rows to this JSON file.")] = None,
    comm: Annotated[Optional[str], typer.Option(help="Comma list of comm modes (native, adaptive) to compare "
                                                     "instead of native vs seam.")] = None,
    testbed: Annotated[Optional[int], typer.Option(max=64, help="Run the ranks on an emulated network of N hosts, "
                                                                "2..64 (root; one rank per host).")] = None,
    congest: Annotated[Optional[list[str]], typer.Option(help="Congestion on the test bed, repeatable: "
                                                              "pair=I-J,rate=R or host=I,rate=R.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Folder for bench.json and events.jsonl.")] = None,
) -> None:
    """nccl-tests-like sweep: time, algbw and busbw per size, native backend vs dtk's seam (or, with --comm,
    comm modes side by side; with --testbed, on an emulated network, congested with --congest)."""
    from dtk.bench import KINDS, run_modes, run_sweep
    from dtk.sizes import parse_size

    testbed = _testbed_hosts(testbed)
    kinds = [k.strip() for k in ops.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise DtkError(f"--ops: got {bad[0]!r}; accepted: {', '.join(KINDS)}")
    if comm is not None or testbed or congest or out_dir:
        modes = [m.strip() for m in (comm or "native,adaptive").split(",") if m.strip()]
        run_modes(nproc=nproc, kinds=kinds, min_bytes=parse_size(min_bytes, "--min-bytes"),
                  max_bytes=parse_size(max_bytes, "--max-bytes"), iters=iters, warmup=warmup, modes=modes,
                  out_dir=out_dir, testbed=testbed, congest=congest or [])
        return

    run_sweep(nproc=nproc, kinds=kinds, min_bytes=parse_size(min_bytes, "--min-bytes"),
              max_bytes=parse_size(max_bytes, "--max-bytes"), iters=iters, warmup=warmup, json_out=json_out)


@app.command()
def probe(
    testbed: Annotated[Optional[int], typer.Option(max=64, help="Probe an emulated network of N hosts, 2..64 "
                                                                "(root; brought up and torn down by this command).")] = None,
    congest: Annotated[Optional[list[str]], typer.Option(help="Congestion on the test bed, repeatable: "
                                                              "pair=I-J,rate=R or host=I,rate=R.")] = None,
    hosts: Annotated[int, typer.Option(min=0, help="Real hosts: run one `dtk probe` per host with the same "
                                                   "--hosts and --rdzv-endpoint, each with its --node-rank.")] = 0,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="host:port where node 0 listens (--hosts).")] = None,
    node_rank: Annotated[int, typer.Option(min=0, help="This host's index, 0..hosts-1 (--hosts).")] = 0,
    interface: Annotated[Optional[str], typer.Option(help="Network interface to probe through (as world.interface); "
                                                          "default: the one that routes to the endpoint.")] = None,
    size: Annotated[str, typer.Option(help="Bytes each side sends per transfer, e.g. 4M.")] = "4M",
    passes: Annotated[int, typer.Option(min=1, help="Transfers per link; the best counts.")] = 3,
    pings: Annotated[int, typer.Option(min=1, help="Round trips per link for the latency.")] = 20,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for every host.")] = 120,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the matrix to this JSON file.")] = None,
) -> None:
    """Bandwidth and latency between every pair of hosts (table + JSON); names the slowest link. Under srun, with
    neither --testbed nor --hosts: the job step's nodes, as `dtk train` takes them."""
    from dtk import probe as pr
    from dtk.sizes import parse_size

    nbytes = parse_size(size, "--size")
    testbed = _testbed_hosts(testbed)
    if hosts == 1:
        raise DtkError("--hosts: got 1; accepted: 2 hosts or more (a probe measures the links between hosts)")
    if not testbed and not hosts:  # under srun (one `dtk probe` per node): the hosts as `dtk train` takes them
        import os

        from dtk.slurm import launch_plan

        plan = launch_plan(dict(os.environ)) or {}
        hosts, node_rank = plan.get("nnodes", 0), plan.get("node_rank", node_rank)
        rdzv_endpoint = rdzv_endpoint or plan.get("rdzv_endpoint")
    if bool(testbed) == bool(hosts):
        raise DtkError(f"--testbed/--hosts: got --testbed {testbed} and --hosts {hosts}; accepted: exactly one of "
                       "--testbed N (emulated hosts) or --hosts N --rdzv-endpoint host:port --node-rank I")
    if testbed:
        if interface is not None:
            raise DtkError(f"--interface: got {interface!r} with --testbed; accepted: only with --hosts (the test "
                           "bed's hosts use eth0)")
        pr.run_testbed(hosts=testbed, congest=congest or [], nbytes=nbytes, passes=passes, pings=pings,
                       json_out=json_out, timeout_s=timeout)
        return
    if congest:
        raise DtkError(f"--congest: got {congest[0]!r} with --hosts; congestion needs the test bed (--testbed N)")
    if rdzv_endpoint is None:
        raise DtkError("--rdzv-endpoint: missing; accepted: host:port of node 0 (the same on every host)")
    pr.run_hosts(hosts=hosts, endpoint=_parse_endpoint(rdzv_endpoint), node_rank=node_rank, interface=interface,
                 nbytes=nbytes, passes=passes, pings=pings, json_out=json_out, timeout_s=timeout)


testbed_app = typer.Typer(no_args_is_help=True, **HELP, help="An emulated multi-host network on this machine (root).")
app.add_typer(testbed_app, name="testbed")
NameOpt = Annotated[str, typer.Option("--name", help="The test bed's tag (namespaces dtk<name>h<I>).")]


@testbed_app.command("up")
def testbed_up(
    hosts: Annotated[int, typer.Argument(min=2, max=64, help="Number of hosts.")],
    name: NameOpt = "cli",
    congest: Annotated[Optional[list[str]], typer.Option(help="pair=I-J,rate=R or host=I,rate=R; repeatable.")] = None,
) -> None:
    """Create N hosts (namespaces on a bridge, 10.x addresses), optionally congested; stays up until `down`."""
    from dtk.testbed import shape
    from dtk.testbed.net import Testbed, check_environment

    check_environment()
    specs = [shape.parse(c, hosts=hosts) for c in congest or []]
    bed = Testbed(n=hosts, tag=name, owner=0).up()
    try:
        shape.apply(bed, specs)
    except BaseException:
        bed.down()
        raise
    out.print(f"test bed {name!r}: {hosts} hosts " + ", ".join(f"{bed.host(i)}={bed.ip(i)}" for i in range(hosts))
              + f"; launcher side {bed.root_link}={bed.root_ip}" + (f"; congested: {', '.join(congest)}" if congest else ""))
    out.print(f"run a command on host 0: ip netns exec {bed.host(0)} <cmd>   (GLOO_SOCKET_IFNAME=eth0)")


@testbed_app.command("down")
def testbed_down(
    name: NameOpt = "cli",
    all_: Annotated[bool, typer.Option("--all", help="Every dtk test bed on this machine.")] = False,
    stale: Annotated[bool, typer.Option(help="Only those whose owning process is gone.")] = False,
) -> None:
    """Remove a test bed: its processes, namespaces, links and qdiscs."""
    from dtk.testbed.net import check_environment, remove_stale, status, teardown

    check_environment()
    if stale:
        gone = remove_stale()
    else:
        gone = [s["tag"] for s in status()] if all_ else [name]
        for tag in gone:
            teardown(tag)
    out.print(f"removed: {', '.join(gone) or 'nothing'}")


@testbed_app.command("status")
def testbed_status() -> None:
    """The dtk test beds on this machine, their hosts and the congestion in force."""
    from dtk.testbed.net import check_environment, status

    check_environment()
    rows = status()
    if not rows:
        out.print("no dtk test bed is up")
    for s in rows:
        subnet = f"10.{s['subnet'][0]}.{s['subnet'][1]}.0/24" if s.get("subnet") else "?"
        owner = "" if not s["owner"] else f", owner pid {s['owner']}" + (" (gone: stale)" if s["stale"] else "")
        out.print(f"{s['tag']}: {s['hosts']} hosts, {subnet}{owner}; congestion: {', '.join(s['shaping']) or 'none'}")


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except DtkError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except typer.TyperException as e:  # typer's usage errors: one line, like ours
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help())
            sys.exit(0)
        message = e.format_message().splitlines()[0]
        # typer checks option values with pydantic, whose message leaves out the value the user gave
        errors = getattr(e.__cause__, "errors", None)
        if callable(errors) and errors() and "input" in errors()[0]:
            message += f"; got {errors()[0]['input']!r}"
        print(f"error: {message}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

