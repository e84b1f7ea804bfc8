"""The `dtk` command line: train, validate, compare, inject-failure, bench, and the registries' listings.

User mistakes print one `error:` line each and exit 2; a failed run exits 1; bugs keep their traceback.
"""
from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dtk import recipe as recipes
from dtk.errors import RUN_FAILED_EXIT, USER_ERROR_EXIT, DtkError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="dtk: one recipe, trained under DDP, FSDP or DeepSpeed ZeRO, with resilience and comm layers.")
bench_app = typer.Typer(no_args_is_help=True, help="Measure dtk against its peers.")
app.add_typer(bench_app, name="bench")
out = Console()

RecipeArg = Annotated[str, typer.Argument(help="The recipe YAML file.")]
OverridesArg = Annotated[Optional[list[str]], typer.Argument(help="Overrides as key.path=value, e.g. training.steps=50.")]


def _parse_endpoint(value: str | None) -> str | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DtkError(f"--rdzv-endpoint: got {value!r}; accepted: host:port with a port in 1..65535")
    return value


@app.command()
def train(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nnodes: Annotated[int, typer.Option(min=1, help="Number of nodes (torchrun spelling).")] = 1,
    node_rank: Annotated[int, typer.Option(min=0, help="This node's index, 0..nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="host:port of node 0's store; default loopback.")] = None,
    progress: Annotated[bool, typer.Option(help="Show the live progress line.")] = True,
) -> None:
    """Train a recipe: start the ranks, show progress, leave a run folder."""
    from dtk.launch import Topology, launch

    r = recipes.load(recipe, overrides or [])
    if node_rank >= nnodes:
        raise DtkError(f"--node-rank: got {node_rank}; accepted: 0..{nnodes - 1} (--nnodes is {nnodes})")
    topo = Topology(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=_parse_endpoint(rdzv_endpoint))
    code, run_dir = launch(r, recipe_path=recipe, topology=topo, show_progress=progress)
    _print_run_result(run_dir, code)
    raise typer.Exit(code)


def _print_run_result(run_dir, code: int) -> None:
    import json

    from dtk.report import human_bytes

    summary = json.loads((run_dir / "summary.json").read_text())
    if code == 0:
        out.print(f"[green]done[/]: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
                  f"{summary['throughput']:,.0f} {summary['throughput_unit']}, "
                  f"p50 step {summary['step_time_p50'] * 1000:.0f} ms, "
                  f"peak {human_bytes(summary['peak_memory_bytes'])}, "
                  f"comm {human_bytes(summary['comm']['bytes_per_step'])}/step; run folder {run_dir}")
        for f in summary["failures"]:
            out.print(f"  recovered: rank {f['rank']} ({f['fault']}) at step {f.get('step')}, "
                      f"in {f.get('recovery_s', 0):.2f}s")
    else:
        out.print(f"[red]failed[/]: run folder {run_dir}", highlight=False)


@app.command()
def validate(recipe: RecipeArg, overrides: OverridesArg = None) -> None:
    """Check a recipe (and overrides) without running it; print the resolved recipe."""
    r = recipes.load(recipe, overrides or [])
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


@bench_app.command("comm")
def bench_comm(
    nproc: Annotated[int, typer.Option(min=2, max=16, help="Local ranks.")] = 2,
    ops: Annotated[str, typer.Option(help="Comma list of all_reduce, all_gather, reduce_scatter.")] = "all_reduce,all_gather,reduce_scatter",
    min_bytes: Annotated[str, typer.Option(help="Smallest size, e.g. 4K.")] = "4K",
    max_bytes: Annotated[str, typer.Option(help="Largest size, e.g. 64M.")] = "64M",
    iters: Annotated[int, typer.Option(min=1)] = 5,
    warmup: Annotated[int, typer.Option(min=0)] = 2,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Also write the rows to this JSON file.")] = None,
) -> None:
    """nccl-tests-like sweep: time, algbw and busbw per size, native backend vs dtk's seam."""
    from dtk.comm.bench import parse_size, run_sweep

    kinds = [k.strip() for k in ops.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("all_reduce", "all_gather", "reduce_scatter")]
    if bad:
        raise DtkError(f"--ops: got {bad[0]!r}; accepted: all_reduce, all_gather, reduce_scatter")
    run_sweep(nproc=nproc, kinds=kinds, min_bytes=parse_size(min_bytes, "--min-bytes"),
              max_bytes=parse_size(max_bytes, "--max-bytes"), iters=iters, warmup=warmup, json_out=json_out)


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
        print(f"error: {e.format_message().splitlines()[0]}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

__all__ = ["app", "main", "RUN_FAILED_EXIT"]
