"""`dtk compare`: one recipe run under several variants (strategies, or any overrides), one run after another,
set side by side with the ZeRO paper's analytic figures; prints one table, writes compare.json/.md/.png."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from dtk import recipe as recipes
from dtk.errors import DtkError
from dtk.report import human_bytes
from dtk.resilience import faults as fl
from dtk.resilience.failures import FailureRecord

STRATEGY_NAMES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "gcpsl", "gcpsl_serial")
# the serial split-learning baseline runs every cluster on one rank, whatever the recipe's world
EXTRA_OVERRIDES = {"gcpsl_serial": ["world.nproc=1"]}
# Every variant trains on the same seed, data and steps; the compare folder owns the run folders.
SHARED_KEYS = ("training.seed", "training.steps", "data", "output")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_NEXT_ASSIGNMENT = re.compile(r",(?=\s*[A-Za-z_][\w.]*=)")  # split "a=1,b=[1,2]" only before "key="
VARIANT_FORM = "NAME:key=value[,key=value...] (e.g. inplace:resilience.mode=inplace)"


@dataclass(kw_only=True, slots=True)
class Variant:
    name: str
    overrides: list[str]
    flag: str
    """The flag and value it came from, for error messages."""
    recipe: recipes.Recipe | None = None


# -- parsing the comparison axis --

def parse_strategies(value: str) -> list[Variant]:
    names = [s.strip() for s in value.split(",")]
    for name in names:
        if name not in STRATEGY_NAMES:
            raise DtkError(f"--strategies: got {name!r} in {value!r}; accepted: a comma list of "
                           f"{', '.join(STRATEGY_NAMES)}")
    return [Variant(name=n, overrides=[f"strategy.name={n}", *EXTRA_OVERRIDES.get(n, [])], flag=f"--strategies {value}")
            for n in names]


def parse_variant(value: str) -> Variant:
    name, sep, body = value.partition(":")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise DtkError(f"--variant: got {value!r}; accepted: {VARIANT_FORM}; NAME of letters, digits, _ . + -")
    overrides = [item.strip() for item in _NEXT_ASSIGNMENT.split(body)] if body.strip() else []
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key or any(not part for part in key.split(".")):
            raise DtkError(f"--variant: got {item!r} in {value!r}; accepted: {VARIANT_FORM}")
        if any(key == k or key.startswith(k + ".") for k in SHARED_KEYS):
            raise DtkError(f"--variant: got {key!r} in {value!r}; every variant shares seed, data, steps and "
                           f"output; accepted: any other key (set {key} for all as a plain override)")
    return Variant(name=name, overrides=overrides, flag=f"--variant {value}")


def resolve(recipe_path: str, overrides: list[str], *, strategies: str | None,
            variant_flags: list[str]) -> list[Variant]:
    """All variants, validated before anything runs; each recipe = file + overrides + the variant's overrides."""
    tree = recipes.read_file(recipe_path)
    shared = recipes.build(tree, overrides)  # the shared part's own mistakes, reported without a variant's name
    variants = (parse_strategies(strategies) if strategies else []) + [parse_variant(v) for v in variant_flags]
    if len(variants) < 2:
        raise DtkError(f"--strategies/--variant: got {len(variants)} variant(s); accepted: two or more, e.g. "
                       f"--strategies ddp,zero3 or --variant {VARIANT_FORM}")
    seen: set[str] = set()
    for v in variants:
        if v.name in seen:
            raise DtkError(f"{v.flag.split()[0]}: variant name {v.name!r} given twice; accepted: distinct names")
        seen.add(v.name)
        if "strategy.name=gcpsl_serial" in v.overrides and shared.strategy.clusters is None:
            v.overrides.append(f"strategy.clusters={shared.world.nproc}")  # the clusters gcpsl would run, one per rank
        try:
            v.recipe = recipes.build(tree, [*overrides, *v.overrides])
        except DtkError as e:
            raise DtkError(*(f"{v.flag}: {line}" for line in e.lines)) from None
    return variants


# -- the ZeRO paper's model-state and communication volumes --

def parameter_count(recipe: recipes.Recipe) -> int:
    """Ψ, from the model built on CPU in this process (no ranks started)."""
    from dtk.data import build_dataset
    from dtk.models import build_model

    spec = build_dataset(recipe.data, seed=recipe.training.seed).spec
    return sum(p.numel() for p in build_model(recipe.model, spec, seed=recipe.training.seed).parameters())


def _state_bytes(recipe: recipes.Recipe) -> tuple[int, int, int]:
    """Bytes per parameter of (parameters, gradients, optimizer states) as the strategy keeps them."""
    opt = recipe.optimizer
    moments = 8 if opt.name == "adamw" else 4 if opt.momentum else 0
    if recipe.strategy.name.startswith("zero"):
        # DeepSpeed: an fp32 master copy + moments (the paper's K=12) whatever the model's dtype; params and grads
        # in the model's dtype (fp32 training keeps two fp32 copies of the parameters: the model's and the master)
        width = 2 if recipe.training.precision == "bf16" else 4
        return width, width, 4 + moments
    return 4, 4, moments  # torch DDP/FSDP keep fp32 params and grads; bf16 is a compute copy (autocast / mp policy)


def _term(coeff: float, per_rank: bool) -> str:
    return f"{coeff:g}Ψ" + ("/N" if per_rank else "")


def model_state_analytic(recipe: recipes.Recipe, *, params: int, world: int) -> tuple[float, str]:
    """Model states per rank (parameters, gradients, optimizer states; no activations or buffers) and the formula.
    fsdp with reshard_after_forward=false is counted as ZeRO-2: its parameters are whole from forward through
    backward, which is what the peak sees; gradients and optimizer states stay sharded."""
    p, g, k = _state_bytes(recipe)
    name = recipe.strategy.name
    if name.startswith("gcpsl"):  # every rank holds whole client + server segments for each cluster it runs
        clusters = (recipe.strategy.clusters or 1) if name == "gcpsl_serial" else 1
        return params * (p + g + k) * clusters, f"{clusters}×{p + g + k}Ψ" if clusters > 1 else f"{p + g + k}Ψ"
    if name == "fsdp":
        name = "zero3" if recipe.strategy.reshard_after_forward else "zero2"
    whole, sharded = {"ddp": (p + g + k, 0), "zero1": (p + g, k), "zero2": (p, g + k), "zero3": (0, p + g + k)}[name]
    formula = "+".join([_term(whole, False)] * bool(whole) + [_term(sharded, True)] * bool(sharded))
    return params * (whole + sharded / world), formula


def comm_analytic(recipe: recipes.Recipe, *, params: int, world: int) -> tuple[float, str]:
    """Wire bytes per rank per step (size x (N-1)/N per pass, as the seam counts them) and the volume in Ψ.
    A pass is one reduce-scatter or all-gather of Ψ; an all-reduce is two. Gradient reductions happen once per
    step where the strategy defers them to the last micro-step (ddp, fsdp, zero1), once per micro-step otherwise."""
    s, accum = recipe.strategy, recipe.training.grad_accum
    bf16 = recipe.training.precision == "bf16"
    if s.name == "gcpsl_serial":
        return 0.0, "0"
    if s.name == "gcpsl":  # one all-reduce of the fp32 segments every merge_every steps
        return params * 2 * 4 * (world - 1) / world / s.merge_every, f"2Ψ/{s.merge_every}"
    if s.name == "ddp":
        terms = [(2, 4)]  # all-reduce of fp32 gradients (autocast keeps fp32 parameters)
    elif s.name == "fsdp":  # all-gather in param_dtype (forward, and again in backward when resharded); fp32 reduce
        gathers = (2 if s.reshard_after_forward else 1) * accum
        terms = [(gathers, 2 if bf16 else 4), (1, 4)]
    else:
        width = 2 if bf16 else 4  # DeepSpeed communicates in the model dtype
        terms = {"zero1": [(2, width)], "zero2": [(2 * accum, width)], "zero3": [(3 * accum, width)]}[s.name]
    if len({b for _, b in terms}) == 1:
        volume = f"{sum(n for n, _ in terms)}Ψ"
    else:
        volume = "+".join(f"{n}Ψ·{'bf16' if b == 2 else 'fp32'}" for n, b in terms)
    return params * sum(n * b for n, b in terms) * (world - 1) / world, volume.replace("+1Ψ", "+Ψ")


def max_rel_diff(losses: list[float], reference: list[float]) -> float:
    """Largest |loss - reference| / |reference| over the steps; a NaN on either side counts as infinite."""
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]
    return max((d if d == d else float("inf") for d in diffs), default=0.0)


# -- running --

@dataclass(kw_only=True)
class Comparison:
    out_dir: Path
    command: str
    variants: list[dict] = field(default_factory=list)
    parity_tolerance: float | None = None
    faults: list[str] = field(default_factory=list)
    """The fault schedule every variant got (dtk compare --fault)."""

    @property
    def done(self) -> list[dict]:
        return [v for v in self.variants if v["status"] == "completed"]

    @property
    def learning(self) -> bool:
        """True when some variant measured held-out accuracy (gcpsl): the table gains its columns."""
        return any(v.get("accuracy") is not None for v in self.variants)

    @property
    def evaluated(self) -> bool:
        """True when some variant evaluated on held-out data (eval.every): the table gains an eval-loss column."""
        return any(v.get("eval_loss") is not None for v in self.variants)

    def verdict(self) -> dict[str, str]:
        done = self.done
        if not done:
            return {}
        return {"fastest": max(done, key=lambda v: v["throughput"])["variant"],
                "leanest_memory": min(done, key=_memory)["variant"],
                "least_traffic": min(done, key=lambda v: v["comm_bytes_per_step"])["variant"],
                **({"first_to_target": min(reached, key=lambda v: v["time_to_target_s"])["variant"]}
                   if (reached := [v for v in done if v.get("time_to_target_s") is not None]) else {})}

    def parity_failures(self) -> list[dict]:
        tol = self.parity_tolerance
        if tol is None:
            return []
        return [v for v in self.variants[1:] if v["max_rel_loss_diff"] is not None and v["max_rel_loss_diff"] > tol]


def _memory(v: dict) -> float:
    """What the memory verdict compares: the measured model states (CPU RSS mostly holds libraries), else the peak."""
    return v["model_state_bytes"] if v.get("model_state_bytes") is not None else v["peak_memory_bytes"]


def prepare_out_dir(out: str | None, recipe_path: str) -> Path:
    path = Path(out) if out else Path("runs") / f"compare-{Path(recipe_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DtkError(f"--out: got {str(path)!r}; it exists and is not empty; accepted: a new or empty folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DtkError(f"--out: got {str(path)!r}; cannot create it ({e.strerror})") from None
    return path


def _record(v: Variant, *, code: int, run_dir: Path, params: int, world: int) -> dict:
    assert v.recipe is not None  # resolved before any variant runs
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    states, states_formula = model_state_analytic(v.recipe, params=params, world=world)
    failures = [FailureRecord.from_dict(f) for f in summary.get("failures", [])]
    downtimes = [f.figures.downtime_s for f in failures if f.figures and f.figures.downtime_s is not None]
    comm, comm_formula = comm_analytic(v.recipe, params=params, world=world)
    return {
        "variant": v.name,
        "overrides": v.overrides,
        "strategy": v.recipe.strategy.name,
        "status": "completed" if code == 0 else "failed",
        "exit_code": code,
        "run_dir": str(run_dir),
        "params": params,
        "world_size": world,
        "precision": v.recipe.training.precision,
        "optimizer": v.recipe.optimizer.name,
        "grad_accum": v.recipe.training.grad_accum,
        "throughput": summary.get("throughput"),
        "throughput_unit": summary.get("throughput_unit"),
        "step_time_p50": summary.get("step_time_p50"),
        "step_time_p95": summary.get("step_time_p95"),
        "untimed_steps": summary.get("untimed_steps"),
        "peak_memory_bytes": summary.get("peak_memory_bytes"),
        "model_state_bytes": summary.get("model_state_bytes"),
        "model_state": summary.get("model_state"),
        "model_state_bytes_analytic": states,
        "model_state_formula": states_formula,
        "comm_bytes_per_step": summary.get("comm", {}).get("bytes_per_step"),
        "comm_bytes_per_step_analytic": comm,
        "comm_formula": comm_formula,
        "comm_by_kind": summary.get("comm", {}).get("by_kind", {}),
        "final_loss": summary.get("final_loss"),
        "eval_loss": summary.get("eval_loss"),
        "failures": len(failures),
        "downtime_s": sum(downtimes),
        "steps_lost": sum(f.steps_lost or 0 for f in failures),
        "productive_time_ratio": summary.get("productive_time_ratio"),
        "losses": summary.get("losses", []),
        "max_rel_loss_diff": None,
        "accuracy": summary.get("accuracy"),
        "best_accuracy": summary.get("best_accuracy"),
        "participation": summary.get("participation"),
        "target_accuracy": summary.get("target_accuracy"),
        "time_to_target_s": summary.get("time_to_target_s"),
    }


def run(*, recipe_path: str, variants: list[Variant], out_dir: Path, command: str, console: Console,
        parity_tolerance: float | None = None, show_progress: bool = True, inject: list | None = None,
        testbed: int = 0, fault_schedule: list | None = None, schedule_kind: str = "kill") -> Comparison:
    """Run the variants one after another (they must not share the CPU), each in its own run folder; with `testbed`
    each on its own emulated network of that many hosts (world.nproc ranks per host). `fault_schedule` ((seconds
    after start, rank), --mtbf): the same random faults of `schedule_kind` for every variant."""
    from dtk.launch import run_here

    comparison = Comparison(out_dir=out_dir, command=command, parity_tolerance=parity_tolerance,
                            faults=[f.as_fault() if f.kind == "congest" else f.spec() for f in inject or []]
                            + ([f"random {schedule_kind} faults, the first at "
                                + ", ".join(f"{t:.1f}s (rank {r})" for t, r in fault_schedule[:3]) + ", ..."]
                               if fault_schedule else []))
    counts: dict[str, int] = {}
    for i, v in enumerate(variants, 1):
        assert v.recipe is not None  # resolved before any variant runs
        key = json.dumps([v.recipe.model.model_dump(mode="json"), v.recipe.data.model_dump(mode="json")])
        if key not in counts:
            counts[key] = parameter_count(v.recipe)
        v.recipe.output.dir = str(out_dir / v.name)
        console.print(f"[bold]\\[{i}/{len(variants)}] {v.name}[/]: {' '.join(v.overrides) or '(the recipe as is)'}",
                      highlight=False)
        fl.arm_checksums(v.recipe.resilience, faults=inject or [],
                         random_kind=schedule_kind if fault_schedule else None)
        code, run_dir = run_here(v.recipe, recipe_path=recipe_path, testbed=testbed, show_progress=show_progress,
                                 inject=list(inject or []), fault_schedule=list(fault_schedule or []),
                                 schedule_kind=schedule_kind)
        record = _record(v, code=code, run_dir=run_dir, params=counts[key],
                         world=v.recipe.world.nproc * max(testbed, 1))
        if code != 0:
            console.print(f"[red]failed[/]: {v.name} (exit {code}); run folder {run_dir}", highlight=False)
        comparison.variants.append(record)
        if code in (130, 143):  # interrupted (Ctrl-C, SIGTERM): stop here, keep what ran
            break
    reference = comparison.variants[0]
    for record in comparison.variants:
        if record["status"] == "completed" and reference["status"] == "completed":
            record["max_rel_loss_diff"] = max_rel_diff(record["losses"], reference["losses"])
    return comparison


# -- what a person sees --

def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.0f}"


def _bytes(n: float | None) -> str:
    return "—" if n is None else human_bytes(n)


def _unit(comparison: Comparison) -> str:
    units = {v["throughput_unit"] for v in comparison.done}
    return units.pop() if len(units) == 1 else "per s"


def rows(comparison: Comparison, *, sep: str = "\n") -> list[list[str]]:
    """One row of cells per variant; an analytic cell holds the value, then `sep`, then the formula."""
    out = []
    for v in comparison.variants:
        ok = v["status"] == "completed"
        diff = v["max_rel_loss_diff"]
        out.append([
            v["variant"] if ok else f"{v['variant']} (failed)",
            f"{v['throughput']:,.0f}" if ok else "—",
            f"{_ms(v['step_time_p50'])} / {_ms(v['step_time_p95'])}" if ok else "—",
            _bytes(v["peak_memory_bytes"]) if ok else "—",
            _bytes(v.get("model_state_bytes")) if ok else "—",
            f"{_bytes(v['model_state_bytes_analytic'])}{sep}{v['model_state_formula']}",
            _bytes(v["comm_bytes_per_step"]) if ok else "—",
            f"{_bytes(v['comm_bytes_per_step_analytic'])}{sep}{v['comm_formula']}",
            f"{v['final_loss']:.4f}" if ok and v["final_loss"] is not None else "—",
        ] + ([f"{v['eval_loss']:.4f}" if ok and v.get("eval_loss") is not None else "—"] if comparison.evaluated else []) + [
            "—" if diff is None else "ref" if v is comparison.variants[0] else f"{diff:.1e}" if diff else "0",
        ] + ([f"{v['downtime_s']:.2f}" if ok else "—", str(v["steps_lost"]) if ok else "—",
              f"{v['productive_time_ratio']:.3f}" if ok and v["productive_time_ratio"] is not None else "—"]
             if comparison.faults else []))
        if comparison.learning:
            out[-1] += [_share(v.get("accuracy")), _share(v.get("participation")),
                        "—" if v.get("time_to_target_s") is None else f"{v['time_to_target_s']:.2f}"]
    return out


def _share(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def headers(comparison: Comparison, *, sep: str = "\n") -> list[str]:
    first = comparison.variants[0]["variant"]
    return ["variant", f"throughput{sep}{_unit(comparison)}", f"step ms{sep}p50 / p95", f"peak memory{sep}measured",
            f"model states{sep}measured", f"model states{sep}analytic", f"comm / step{sep}measured",
            f"comm / step{sep}analytic", f"final{sep}loss"] + ([f"eval{sep}loss"] if comparison.evaluated else []) + [
            f"max rel. loss{sep}diff vs {first}"] + (
        [f"downtime{sep}s", f"steps{sep}lost", f"productive{sep}time ratio"] if comparison.faults else []) + (
        [f"accuracy{sep}held-out", f"direct{sep}participation", f"s to target{sep}{_target(comparison)}"]
        if comparison.learning else [])


def _target(comparison: Comparison) -> str:
    targets = {v["target_accuracy"] for v in comparison.variants if v.get("target_accuracy") is not None}
    return f"{100 * targets.pop():.0f}%" if len(targets) == 1 else "accuracy"


def notes(comparison: Comparison) -> list[str]:
    vs = comparison.variants
    warmups = sorted({v["untimed_steps"] for v in comparison.done})
    params = sorted({v["params"] for v in vs})
    worlds = sorted({v["world_size"] for v in vs})
    setting = sorted({f"{v['precision']} {v['optimizer']}" for v in vs})
    psi = f"Ψ = {params[0]:,} parameters" if len(params) == 1 else "Ψ per variant in compare.json"
    n = f"N = {worlds[0]} ranks" if len(worlds) == 1 else "N per variant"
    lines = [
        f"Throughput and step times leave out each run's first {', '.join(map(str, warmups)) or 0} steps (training.untimed_steps).",
        "Peak memory: measured on the busiest rank (CPU: process RSS peak minus RSS before the model was built, so "
        "it also holds activations, buffers and libraries loaded later, e.g. DeepSpeed; GPU: max allocated). "
        "Model states: parameters, gradients and optimizer states; measured from the engine's own tensors on rank 0 "
        "(it holds the largest shard; gradients where the optimizer steps on them), against the ZeRO "
        f"paper's formulas for {', '.join(setting)}; {psi}, {n}. The memory verdict follows the measured model "
        "states.",
        "Comm: wire bytes per rank per step (size × bus factor) measured at dtk's process-group seam, against the "
        "ZeRO paper's volume (2Ψ or 3Ψ, × (N−1)/N) in bytes of the communicated dtype.",
    ]
    if comparison.faults:
        lines.append(f"Every variant got the same faults: {', '.join(comparison.faults)}. Downtime: from each fault to "
                     "the completion, after recovery, of the step it interrupted (summed); productive time ratio: "
                     "useful step time / wall time.")
    if comparison.learning:
        lines.append("Split learning (gcpsl): accuracy on held-out data after the last merge; direct participation = "
                     "share of the training samples drawn at least once per epoch; time to target = seconds of "
                     "training (evaluation left out) until the merged model first reached the target accuracy.")
    if any(v["strategy"] in ("zero1", "zero2") for v in vs):
        lines.append("DeepSpeed ZeRO-1/2 reduce each gradient partition to its owner and all-gather the updated "
                     "parameters (use_multi_rank_bucket_allreduce: false); a reduce counts S·(N−1)/N, as a "
                     "reduce-scatter.")
    if any(v["strategy"].startswith("zero") for v in vs):
        lines.append("DeepSpeed keeps an fp32 master copy of its parameter partition whatever the model's dtype "
                     "(counted in the optimizer states, the paper's K=12).")
    if any(v["strategy"] == "zero1" and v.get("grad_accum", 1) == 1 for v in vs):
        lines.append("DeepSpeed's ZeRO-1 with one micro-step per step reduces gradients into partitions during "
                     "backward, as ZeRO-2 does: it holds less than the paper's whole gradients (4Ψ).")
    if any(v["strategy"] == "fsdp" and "reshard_after_forward" in " ".join(v["overrides"]) for v in vs):
        lines.append("fsdp with reshard_after_forward=false is counted as ZeRO-2: parameters whole from forward "
                     "through backward, gradients and optimizer states sharded.")
    return lines


def verdict_line(comparison: Comparison) -> str:
    by_name = {v["variant"]: v for v in comparison.variants}
    verdict = comparison.verdict()
    if not verdict:
        return "verdict: no variant completed"
    fast, lean, quiet = (by_name[verdict[k]] for k in ("fastest", "leanest_memory", "least_traffic"))
    line = (f"verdict: fastest {fast['variant']} ({fast['throughput']:,.0f} {fast['throughput_unit']}); "
            f"leanest in memory {lean['variant']} ({human_bytes(_memory(lean))} "
            f"{'model states' if lean.get('model_state_bytes') is not None else 'peak'}); "
            f"least traffic {quiet['variant']} ({human_bytes(quiet['comm_bytes_per_step'])}/step)")
    if "first_to_target" in verdict:
        first = by_name[verdict["first_to_target"]]
        others = [v for v in comparison.done if v is not first and v.get("time_to_target_s")]
        versus = "".join(f", {v['time_to_target_s'] / first['time_to_target_s']:.2f}x before {v['variant']}"
                         for v in others)
        line += f"; first to target {first['variant']} ({first['time_to_target_s']:.2f} s{versus})"
    return line


def table(comparison: Comparison) -> Table:
    t = Table(title=f"dtk compare — {comparison.out_dir}", caption="\n".join(notes(comparison)),
              caption_justify="left", box=box.SIMPLE_HEAD)
    for i, h in enumerate(headers(comparison)):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0, overflow="fold")
    for row in rows(comparison):
        t.add_row(*row)
    return t


def markdown(comparison: Comparison) -> str:
    head = headers(comparison, sep=" ")
    lines = ["# dtk compare", "", f"`{comparison.command}`", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(comparison, sep=" = ")]
    lines += [""] + [f"- {n}" for n in notes(comparison)] + ["", f"**{verdict_line(comparison)}**", ""]
    return "\n".join(lines)


def plot(comparison: Comparison, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = comparison.variants
    names = [v["variant"] for v in vs]
    mib = 1024 ** 2
    fig, ((ax_loss, ax_tp), (ax_mem, ax_comm)) = plt.subplots(2, 2, figsize=(12, 8))
    for v in vs:
        ax_loss.plot(range(len(v["losses"])), v["losses"], label=v["variant"], linewidth=1.2)
    ax_loss.set(title="loss (same seed, data, steps)", xlabel="step", ylabel="loss")
    ax_loss.legend()
    x = list(range(len(vs)))
    ax_tp.bar(x, [v["throughput"] or 0 for v in vs], color="tab:blue")
    ax_tp.set(title=f"throughput ({_unit(comparison)}, after warm-up)", xticks=x, xticklabels=names)
    if comparison.faults:  # what the same faults cost each variant, written on its bar
        for i, v in enumerate(vs):
            if v["status"] == "completed":
                ax_tp.annotate(f"downtime {v['downtime_s']:.2f}s\nsteps lost {v['steps_lost']}\n"
                               f"productive {v['productive_time_ratio']:.2f}", (i, 0), xytext=(0, 8),
                               textcoords="offset points", ha="center", fontsize=8, color="white")
    for ax, key, title in ((ax_mem, "model_state_bytes", "model states, rank 0 (MiB)"),
                           (ax_comm, "comm_bytes_per_step", "comm bytes / step / rank (MiB)")):
        ax.bar([i - 0.2 for i in x], [(v.get(key) or 0) / mib for v in vs], width=0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [v[f"{key}_analytic"] / mib for v in vs], width=0.4, hatch="//", fill=False,
               label="analytic")
        ax.set(title=title, xticks=x, xticklabels=names)
        ax.legend()
    fig.suptitle(comparison.command, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(comparison: Comparison) -> None:
    out = comparison.out_dir
    doc = {"command": comparison.command, "parity_tolerance": comparison.parity_tolerance, "faults": comparison.faults,
           "verdict": comparison.verdict(), "notes": notes(comparison), "variants": comparison.variants}
    (out / "compare.json").write_text(json.dumps(doc, indent=2))
    (out / "compare.md").write_text(markdown(comparison))
    plot(comparison, out / "compare.png")
