"""The typed recipe: YAML file + `a.b=c` overrides -> a validated `Recipe`, every mistake reported at once.

Precedence is command line > file > defaults. Unknown keys are rejected; choices are `Literal`s, so the
error names what would be accepted.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dtk.errors import DtkError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class HFModelConfig(Section):
    model_type: str | None = None
    """A transformers model type with a causal LM (gpt2, llama, mistral, ...), built from its config with fresh
    weights."""
    path: str | None = None
    """A local folder holding config.json (as `save_pretrained` writes it); weights in it are loaded. Never a hub
    name: dtk downloads nothing."""
    config: dict[str, Any] = {}
    """Config fields (n_layer, hidden_size, ...) over the model type's defaults or the folder's config.json.
    vocab_size and the context length default to the data's; use_cache defaults to false (training)."""


class ModelConfig(Section):
    name: Literal["gpt", "mlp", "cnn", "resnet"] = "gpt"
    """Built-in model; ignored when `target` or `hf` is set."""
    target: str | None = None
    """A user model as `package.module:function`; the function takes the data spec and returns an nn.Module."""
    layers: int = Field(2, ge=1)
    width: int = Field(64, ge=1)
    heads: int = Field(4, ge=1)
    """Attention heads (gpt); must divide `width`."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for a `target` model."""
    hf: HFModelConfig | None = None
    """A HuggingFace transformers causal LM (needs the hf extra: pip install -e ".[hf]")."""


class DataConfig(Section):
    name: Literal["synthetic", "digits", "text", "cifar10", "tokens"] = "synthetic"
    """Built-in data set; ignored when `target` is set."""
    path: str | None = None
    """Text file for `text` (char-level); for `cifar10`, the folder of its binary batches (cifar-10-batches-bin); for
    `tokens`, the folder `dtk data prepare` wrote (train.bin, val.bin, meta.json, tokenizer/)."""
    target: str | None = None
    """A user data set as `package.module:function`; the function takes seed= and `kwargs` and returns an object with
    `spec` (dtk.data.DataSpec), batch(*, step, rank, micro, size) and optionally val_batch(*, index, size)."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for a `target` data set."""
    held_out: float = Field(0.0, ge=0.0, lt=1.0)
    """digits: share of the images kept out of training; text: share of the file (its end) kept out; both are the
    validation split evaluation reads (cifar10 has its test_batch, tokens its val.bin)."""
    vocab_size: int = Field(64, ge=2)
    """Vocabulary of `synthetic` tokens."""
    seq_len: int = Field(64, ge=2)
    """Tokens per sample (`synthetic`, `text`; `tokens`: meta.json's unless set here); also the gpt context."""


class EvalConfig(Section):
    every: int = Field(0, ge=0)
    """Evaluate on the data's validation split every N steps (and after the last); 0 = never."""
    batches: int = Field(8, ge=1)
    """Held-out batches of training.micro_batch samples per rank in one evaluation (the same ones every time)."""


class StrategyConfig(Section):
    name: Literal["ddp", "fsdp", "zero1", "zero2", "zero3", "gcpsl", "gcpsl_serial"] = "ddp"
    reshard_after_forward: bool = True
    """fsdp: True = full shard (ZeRO-3 like); False = shard gradients and optimizer only (ZeRO-2 like)."""
    offload_optimizer: bool = False
    """zero1/2/3: keep optimizer states in host memory and step them with DeepSpeedCPUAdam."""
    bucket_mb: float = Field(25.0, gt=0)
    """Gradient bucket size in MiB: ddp's buckets; zero1/2/3: DeepSpeed's reduce and all-gather buckets (in the
    model's dtype; DeepSpeed's own default is 5e8 elements, 2 GB in fp32, whatever the model) and, zero3, the
    optimizer's sub-groups. The losses do not depend on it."""
    wrap: list[str] = []
    """fsdp: class names of the submodules sharded one by one (e.g. [GPT2Block]); default: the model's
    `_no_split_modules` (transformers), else the members of its largest nn.ModuleList of repeated blocks."""
    clients: int = Field(256, ge=1)
    """gcpsl: logical split-learning clients the training data is shared out to."""
    clusters: int | None = Field(None, ge=1)
    """gcpsl: fixed groups of clients, one GPSL workload each; default: one per rank (gcpsl_serial: set it)."""
    assignment: Literal["random", "size_balanced", "label_aware"] = "random"
    """gcpsl: how clients are put into clusters: at random (equal client counts), by data size (equal data per
    cluster), or by labels (equal data and similar class mixes)."""
    cut: int = Field(1, ge=1)
    """gcpsl: the model's first `cut` layers form the client segment, the rest the server segment."""
    merge_every: int = Field(5, ge=1)
    """gcpsl: every P steps the client and server segments of all clusters are averaged, weighted by data size."""
    alpha: float = Field(0.5, gt=0)
    """gcpsl: Dirichlet concentration of the non-IID split into clients; small = few classes per client."""


class OptimizerConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.0, ge=0)
    """Clip the global gradient norm to this value; 0 = no clipping. The norm (before clipping) is in every record."""
    schedule: Literal["constant", "cosine", "linear", "wsd"] = "constant"
    """The learning rate after warmup: constant (lr), cosine or linear decay from lr to min_lr by the last step, or
    wsd (warmup-stable-decay: lr until the last decay_steps, then linear to min_lr). The same under every strategy."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup: step s (from 0) uses lr * (s+1) / (warmup_steps+1); the decay starts at lr after it."""
    min_lr: float = Field(0.0, ge=0)
    """The rate cosine, linear and wsd decay to (reached at the last step)."""
    decay_steps: int | None = Field(None, ge=1)
    """wsd: length of the final decay; default: the last 10% of training.steps."""
    no_decay: list[str] = ["bias", "norm", "embedding"]
    """Parameters weight_decay leaves alone (nanoGPT's and torchtitan's convention): `bias` (biases), `norm` (weights
    of normalization layers), `embedding` (embedding tables), or a glob on parameter names (`blocks.*.qkv.weight`).
    [] = decay every parameter."""


class TrainingConfig(Section):
    steps: int = Field(100, ge=1)
    micro_batch: int = Field(16, ge=1)
    """Samples per rank per micro-step."""
    grad_accum: int = Field(1, ge=1)
    seed: int = Field(0, ge=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    """The dtype of the weights and activations where the strategy allows; the optimizer always updates fp32.
    bf16: zero1/2/3 keep bf16 weights and gradients and fp32 master partitions (DeepSpeed's bf16 mode); fsdp
    computes with bf16 copies of its fp32 shards and reduces gradients in fp32 (MixedPrecisionPolicy); ddp and
    gcpsl keep fp32 weights and run the forward under bf16 autocast (as torchtitan and Accelerate do without
    FSDP). summary.json -> dtypes says what the first step used."""
    untimed_steps: int = Field(2, ge=0)
    """The first steps left out of throughput and step-time figures (start-up costs); they train like any other.
    The learning rate's warmup is optimizer.warmup_steps."""
    target_accuracy: float | None = Field(None, gt=0.0, le=1.0)
    """Held-out accuracy whose first reach is reported as time_to_target_s (gcpsl measures accuracy)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of keeping them, per wrap unit (transformer block), under every
    strategy: full = keep only each block's input; selective = also keep matrix products and attention outputs
    (recompute norms and activations). Same losses, less activation memory, more compute."""
    compile: bool = False
    """torch.compile each wrap unit's forward (inductor; on CPU it needs a C++ compiler on PATH). The first steps
    pay the compilation."""


class WorldConfig(Section):
    nproc: int = Field(2, ge=1, le=256)
    """Ranks per node."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on CUDA, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads_per_rank: int = Field(1, ge=1)
    timeout_s: float = Field(300.0, gt=0)
    """Collective timeout of the inner backend."""
    interface: str | None = None
    """The network interface the inner backend binds to (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the
    ranks), e.g. the fast link between hosts rather than the management one. Default: on a multi-node run, the
    interface that routes to the rendezvous endpoint (printed at start, with a warning when a faster-looking one
    is unused); on one node, the backend's own choice."""


class CheckpointConfig(Section):
    every: int = Field(0, ge=0)
    """Save a distributed checkpoint every N steps; 0 = never."""
    resume: Literal["auto", "never"] = "auto"
    """auto: resume from the latest checkpoint in the run folder if there is one."""
    keep: int = Field(2, ge=1)


class OutputConfig(Section):
    dir: str | None = None
    """The run folder; default runs/<recipe name>-<time>."""
    save_final: bool = True
    """At the end of a run, write final/: model.safetensors (the whole model, unsharded, whatever the strategy) and
    recipe.yaml; for model.hf also final/hf/, a save_pretrained folder (with the data's tokenizer when it has one)."""
    loggers: list[Literal["jsonl", "tensorboard", "csv", "wandb", "mlflow"]] = ["jsonl"]
    """Where rank 0 writes each step's record: jsonl (metrics.jsonl, always written), tensorboard (events under
    tensorboard/), csv (metrics.csv), wandb (offline, under wandb/; extra: wandb), mlflow (a file store under
    mlruns/; extra: mlflow). Nothing is sent over the network."""


class ResilienceConfig(Section):
    mode: Literal["none", "checkpoint", "inplace"] = "none"
    """none: a failed rank fails the run. checkpoint: stop every rank, start them again, reload the latest
    checkpoint, redo the lost steps (needs checkpoint.every). inplace: survivors keep their processes and state,
    a shadow takes the failed rank's number and its state is repaired from a peer (ddp) or rebuilt from erasure
    parity (fsdp, zero1/2/3: see parity_group, parity_tier2)."""
    max_failures: int = Field(3, ge=0)
    """Recoveries allowed in one run; the next failure stops it."""
    heartbeat_timeout_s: float | None = Field(None, gt=0)
    """A started rank whose step does not advance for this long is hung: it is killed and recovered. Default (null):
    it follows the run, 10x the p95 step time and at least 5 s (60 s before 3 steps were seen, and while a rank
    saves a checkpoint or recovers)."""
    shadows: int | None = Field(None, ge=0, le=16)
    """Shadow processes per node for in-place recovery: started with the run, built and warmed up, promoted to a
    failed rank's number. Default: 1 when mode is inplace, else 0. 0 = a cold replacement process."""
    checksum_every: int = Field(0, ge=0)
    """Verify every N steps that each rank's local state did not change between steps (bit flips); 0 = never."""
    parity_group: int | None = Field(None, ge=2)
    """Ranks per tier-1 parity group (XOR parity, RAID-5 layout; consecutive ranks); one lost rank per group is
    rebuilt from the others. Default: the ranks of a node (world.nproc), at least 2. Must divide the world size."""
    parity_tier2: int = Field(0, ge=0)
    """Tier 2: Reed-Solomon parity shards across parity groups; survives this many whole groups lost at once
    (e.g. a node). 0 = off. Needs more parity groups than this."""
    protect_every: Union[Literal["auto"], int] = 1
    """Protect (rebuild parity of) every N-th step boundary; a failure rolls back to the last one and redoes at most
    N steps, with the same losses. auto: Young/Daly's interval, sqrt(2 x one protection's measured seconds x
    mtbf_s), in steps (decided after the first step, revised at every protection; summary.json says why)."""
    mtbf_s: Optional[float] = Field(None, gt=0)
    """Mean seconds between failures of the whole job, for protect_every: auto. Default: 6,490 s, what a
    16,384-GPU job sees at `dtk simulate productivity`'s default 6.5 failures per 1,000 node-days."""
    roll_forward: bool = False
    """fsdp in place: keep the XOR of the other ranks' reduced gradient chunks of the last step (one gradient shard
    of host memory; two in an odd world), so that a rank lost in its update, after the step's last collective, is
    rebuilt and makes that update itself while the survivors keep theirs: nothing is redone. Other failures roll
    back as before. Not with optimizer.grad_clip (the clipped update needs every rank's norm)."""


    @field_validator("protect_every", mode="before")
    @classmethod
    def _every(cls, v):
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise PydanticCustomError("protect_every", "accepted: auto, or a number of steps >= 1")

    @model_validator(mode="after")
    def _default_shadows(self):
        if self.shadows is None:
            object.__setattr__(self, "shadows", 1 if self.mode == "inplace" else 0)
        return self


class CommConfig(Section):
    regroup_at: list[int] = []
    """Steps after which every rank rebuilds its inner process group in place (a planned reconfiguration)."""
    mode: Literal["native", "adaptive"] = "native"
    """native: every collective is the backend's own. adaptive: the comm planner watches the links and, when one
    is congested, runs all-reduce / all-gather / reduce-scatter / reduce / broadcast another way (ring order,
    broadcast tree, hierarchical), same result up to the order of the sums."""


class Recipe(Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    strategy: StrategyConfig = StrategyConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    world: WorldConfig = WorldConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    output: OutputConfig = OutputConfig()
    resilience: ResilienceConfig = ResilienceConfig()
    comm: CommConfig = CommConfig()


def _accepted_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _pydantic_lines(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        path = ".".join(str(p) for p in loc) or "<recipe>"
        if e["type"] == "extra_forbidden":
            keys = _accepted_keys(loc)
            lines.append(f"{path}: unknown key; accepted: {', '.join(keys)}")
        else:
            lines.append(f"{path}: got {_short(e.get('input'))}; {e['msg'][0].lower() + e['msg'][1:]}")
    return lines


COMPILED = frozenset({"ddp", "fsdp"})
"""Strategies under which training.compile is offered (tested): their blocks' parameters are whole in forward."""


def _semantic_lines(r: Recipe) -> list[str]:
    """Checks that span fields; each line names the field to change."""
    lines = []
    token_data = r.data.name in ("synthetic", "text", "tokens") or r.data.target is not None
    lines += _data_lines(r)
    if r.model.hf is not None:
        lines += _hf_lines(r, token_data, data_ok=not lines)
    elif r.model.target is None:
        if r.model.name == "gpt" and not token_data:
            lines.append(f"model.name: 'gpt' cannot read data.name {r.data.name!r}; accepted data: synthetic, text, "
                         f"tokens")
        if r.model.name in ("mlp", "cnn", "resnet") and token_data and r.data.target is None:
            lines.append(f"model.name: {r.model.name!r} cannot read token data {r.data.name!r}; accepted data: digits")
        if r.model.name == "gpt" and r.model.width % r.model.heads:
            lines.append(f"model.heads: got {r.model.heads}; must divide model.width ({r.model.width})")
    elif ":" not in r.model.target:
        lines.append(f"model.target: got {r.model.target!r}; accepted: 'package.module:function'")
    if r.training.compile and r.strategy.name not in COMPILED:
        # DeepSpeed fetches and releases parameters in hooks on every submodule, inside the compiled block
        lines.append(f"training.compile: not offered for strategy.name {r.strategy.name!r}; accepted strategies: "
                     f"{', '.join(sorted(COMPILED))}")
    elif r.training.compile:
        from dtk.models.units import compiler_problem  # imports torch: only for a recipe that compiles

        lines += [p for p in [compiler_problem()] if p]
    if r.training.activation_checkpointing != "none" and r.strategy.name.startswith("gcpsl"):
        lines.append(f"training.activation_checkpointing: not offered for strategy.name {r.strategy.name!r}; "
                     "accepted strategies: ddp, fsdp, zero1, zero2, zero3")
    elif r.training.activation_checkpointing == "selective" and r.strategy.name == "zero3":
        # measured: the losses leave the run without checkpointing from the third step on (ZeRO-3's parameter
        # release and the selective recompute's saved matrix products do not agree); full checkpointing matches
        lines.append("training.activation_checkpointing: 'selective' is not offered for strategy.name 'zero3' (its "
                     "losses drift from the run without); accepted: none, full")
    if r.data.name == "cifar10":
        if not r.data.path:
            lines.append("data.path: missing; data 'cifar10' needs the folder of its binary batches "
                         "(cifar-10-batches-bin)")
        elif not Path(r.data.path).is_dir():
            lines.append(f"data.path: got {r.data.path!r}; no such folder")
    if r.strategy.name.startswith("gcpsl"):
        lines += _split_learning_lines(r)
    if r.data.name == "text":
        if not r.data.path:
            lines.append("data.path: missing; data 'text' needs a text file")
        elif not Path(r.data.path).is_file():
            lines.append(f"data.path: got {r.data.path!r}; no such file")
    if r.resilience.roll_forward and r.strategy.name not in ("ddp", "fsdp", "zero3"):
        lines.append(f"resilience.roll_forward: not offered for strategy.name {r.strategy.name!r}; accepted "
                     f"strategies: fsdp, zero3 (ddp redoes nothing already)")
    elif r.resilience.roll_forward and r.strategy.name == "zero3" and r.strategy.offload_optimizer:
        lines.append("resilience.roll_forward: not offered with strategy.offload_optimizer true (the update runs "
                     "from the offloaded gradients); accepted: strategy.offload_optimizer false")
    elif r.resilience.roll_forward and r.optimizer.grad_clip:
        lines.append(f"resilience.roll_forward: not offered with optimizer.grad_clip {r.optimizer.grad_clip} (a "
                     f"clipped update needs every rank's norm); accepted: optimizer.grad_clip 0")
    if r.resilience.mode == "inplace" and r.strategy.name.startswith("gcpsl"):
        lines.append(f"resilience.mode: 'inplace' is not offered for strategy.name {r.strategy.name!r}; accepted "
                     f"strategies: ddp, fsdp, zero1, zero2, zero3")
    if r.resilience.mode == "inplace" and r.strategy.name != "ddp":
        # groups hold whole nodes or tile one; the rest (tier 2 against the number of groups) needs the number of
        # nodes, which the launch knows: check_launch()
        k, n = r.resilience.parity_group or max(2, r.world.nproc), r.world.nproc
        if n % k and k % n:
            divisors = [d for d in range(2, n + 1) if n % d == 0]
            lines.append(f"resilience.parity_group: got {k}; parity groups must tile a node's {n} ranks or hold "
                         f"whole nodes; accepted: {', '.join(map(str, divisors + [2 * n]))}, ... (a multiple of {n})")
    if r.resilience.mode == "checkpoint" and not r.checkpoint.every:
        lines.append("resilience.mode: 'checkpoint' restarts from a checkpoint, but checkpoint.every is 0; "
                     "set checkpoint.every to a number of steps >= 1")
    lines += _schedule_lines(r)
    from dtk.loggers import missing_packages  # no torch: cheap wherever a recipe is read

    for name in missing_packages(list(r.output.loggers)):
        lines.append(f"output.loggers: {name!r} needs the {name} package, which is not installed here; "
                     f"pip install -e \".[{name}]\", or accepted without it: jsonl, csv")
    bad = [s for s in r.comm.regroup_at if not 1 <= s < r.training.steps]
    if bad:
        lines.append(f"comm.regroup_at: got {bad}; steps must lie in 1..{r.training.steps - 1}")
    return lines


def _schedule_lines(r: Recipe) -> list[str]:
    o, steps, lines = r.optimizer, r.training.steps, []
    if o.min_lr > o.lr:
        lines.append(f"optimizer.min_lr: got {o.min_lr}; must be <= optimizer.lr ({o.lr})")
    if o.warmup_steps >= steps:
        lines.append(f"optimizer.warmup_steps: got {o.warmup_steps}; must be < training.steps ({steps})")
    if o.decay_steps is not None and o.schedule != "wsd":
        lines.append(f"optimizer.decay_steps: got {o.decay_steps}; only schedule 'wsd' uses it (schedule is "
                     f"{o.schedule!r}); accepted: null, or optimizer.schedule=wsd")
    elif o.schedule == "wsd" and o.warmup_steps + (o.decay_steps or 0) > steps:
        lines.append(f"optimizer.decay_steps: got {o.decay_steps}; warmup_steps + decay_steps must be <= "
                     f"training.steps ({steps})")
    return lines


def _hf_lines(r: Recipe, token_data: bool, *, data_ok: bool = True) -> list[str]:
    """model.hf: the checks that need no model first; transformers' own only when nothing else is wrong."""
    hf, lines = r.model.hf, []
    assert hf is not None  # called only for a model.hf recipe
    if r.model.target:
        lines.append(f"model.target: got {r.model.target!r} and model.hf; accepted: one of them")
    if (hf.model_type is None) == (hf.path is None):
        lines.append("model.hf: give model_type (a config from scratch) or path (a local folder), exactly one")
    elif hf.path is not None and not (Path(hf.path) / "config.json").is_file():
        lines.append(f"model.hf.path: got {hf.path!r}; no config.json in it; accepted: a local folder holding "
                     "config.json, as save_pretrained writes it")
    if not token_data:
        lines.append(f"model.hf: a causal LM reads tokens, not data.name {r.data.name!r}; accepted data: synthetic, "
                     f"text, tokens")
    if lines or not data_ok or (r.data.name == "text" and not (r.data.path and Path(r.data.path).is_file())):
        return lines
    from dtk.models.hf import recipe_problems  # imports transformers (and torch): only for an hf recipe

    return recipe_problems(r)


def _data_lines(r: Recipe) -> list[str]:
    if r.data.target is None and r.data.name != "tokens" and not r.eval.every:
        return []  # nothing to check, and no torch to import for it
    from dtk.data.checks import data_problems  # numpy, torch and maybe the user's module: only when asked

    return data_problems(r)


# layers in order of each built-in image model (dtk.models: layers_in_order); the cut must fall between two
SPLIT_DEPTH = {"cnn": lambda layers: layers + 1, "mlp": lambda layers: layers + 2, "resnet": lambda layers: layers + 2}


def _split_learning_lines(r: Recipe) -> list[str]:
    s, name, lines = r.strategy, r.strategy.name, []
    if r.data.name not in ("digits", "cifar10"):
        lines.append(f"data.name: {name!r} trains an image classifier; got {r.data.name!r}; accepted: digits, cifar10")
    if r.data.name == "digits" and not r.data.held_out:
        lines.append(f"data.held_out: got 0; {name!r} reports held-out accuracy; accepted: a share in (0, 1), e.g. 0.2")
    clusters = s.clusters or (r.world.nproc if name == "gcpsl" else 1)
    if clusters > s.clients:
        lines.append(f"strategy.clusters: got {clusters}; must be <= strategy.clients ({s.clients})")
    if name == "gcpsl" and s.clusters is not None and s.clusters != r.world.nproc:
        lines.append(f"strategy.clusters: got {s.clusters}; gcpsl runs one cluster per rank; accepted: world.nproc "
                     f"({r.world.nproc}), or gcpsl_serial to run them one after another")
    if name == "gcpsl_serial" and r.world.nproc != 1:
        lines.append(f"world.nproc: got {r.world.nproc}; gcpsl_serial runs every cluster on one rank; accepted: 1")
    if r.training.grad_accum != 1:
        lines.append(f"training.grad_accum: got {r.training.grad_accum}; {name!r} draws one batch per cluster per "
                     f"step; accepted: 1")
    if r.model.target is None and r.model.name in SPLIT_DEPTH:
        depth = SPLIT_DEPTH[r.model.name](r.model.layers)
        if s.cut >= depth:
            lines.append(f"strategy.cut: got {s.cut}; model {r.model.name!r} with {r.model.layers} layers has "
                         f"{depth} places in order; accepted: 1..{depth - 1}")
    return lines


def check_launch(r: "Recipe", *, nnodes: int) -> None:
    """Before any rank starts, when the number of nodes is known: what a recipe alone cannot tell (DtkError, every
    line at once): a user's model imports, in-place recovery has a survivor, the parity groups fit the whole run."""
    from dtk.targets import target_problem

    lines = [target_problem("model.target", r.model.target)] if r.model.target and r.model.hf is None else []
    world = r.world.nproc * nnodes
    if r.resilience.mode == "inplace" and world < 2:
        lines.append(f"resilience.mode: got 'inplace' on a world of {world} rank (world.nproc={r.world.nproc}, "
                     f"{nnodes} node); in-place recovery needs a surviving rank to keep the state; accepted: 2 ranks "
                     f"or more (world.nproc, --nnodes), or resilience.mode=checkpoint with checkpoint.every")
    elif r.resilience.mode == "inplace" and r.strategy.name != "ddp":
        try:
            parity_layout(r.resilience, world=world, nproc_per_node=r.world.nproc)
        except DtkError as e:
            lines += e.lines
    if any(lines):
        raise DtkError(*lines)


def parity_layout(resilience, *, world: int, nproc_per_node: int) -> tuple[int, int]:
    """(ranks per parity group, tier-2 parity shards) that `resilience.parity_group` / `parity_tier2` ask for on
    `world` ranks; a pair that does not fit is a user error naming the field."""
    k = resilience.parity_group or max(2, nproc_per_node)
    if world < 2:
        raise DtkError(f"resilience.parity_group: a world of {world} rank has no peer to hold its parity; "
                       f"accepted: 2 ranks or more")
    if world % k:
        divisors = [d for d in range(2, world + 1) if world % d == 0]
        raise DtkError(f"resilience.parity_group: got {k}; parity groups must tile the {world} ranks; "
                       f"accepted: {', '.join(map(str, divisors))}")
    groups, m = world // k, resilience.parity_tier2
    if m and m >= groups:
        raise DtkError(f"resilience.parity_tier2: got {m}; {world} ranks in parity groups of {k} make {groups} "
                       f"group(s), and tier 2 needs more groups than parity shards; accepted: 0..{groups - 1}")
    return k, m


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise DtkError(f"override: got {item!r}; accepted: key.path=value (e.g. training.steps=50)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        parsed.append((key.split("."), value))
    return parsed


def _apply(tree: dict, path: list[str], value: Any, item: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise DtkError(f"{'.'.join(path[:i + 1])}: is a value, not a section; cannot set {item!r}")
        node = child
    node[path[-1]] = value


def read_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise DtkError(f"recipe: got {str(path)!r}; no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DtkError(f"recipe: {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                       f"{e.start}); accepted: a YAML file") from None
    except OSError as e:
        raise DtkError(f"recipe: got {str(path)!r}; cannot read it ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise DtkError(f"recipe: {str(path)!r} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DtkError(f"recipe: {str(path)!r} holds a {type(data).__name__}; accepted: a mapping of sections")
    return data


RENAMED = {("training", "warmup_steps"): "renamed: the learning rate's warmup is optimizer.warmup_steps; the "
                                        "steps left out of timing figures are training.untimed_steps",
           # not a key that moved, but where a user looks for the weights' dtype
           ("model", "dtype"): "not a key: the weights' dtype is training.precision; accepted there: fp32, bf16"}


def build(tree: dict, overrides: Sequence[str] = ()) -> Recipe:
    tree = copy.deepcopy(tree)
    for path, value in parse_overrides(list(overrides)):
        _apply(tree, path, value, ".".join(path))
    renamed = [f"{'.'.join(key)}: {why}" for key, why in RENAMED.items()
               if isinstance(tree.get(key[0]), dict) and key[1] in tree[key[0]]]
    if renamed:
        raise DtkError(*renamed)
    try:
        recipe = Recipe.model_validate(tree)
    except ValidationError as e:
        raise DtkError(*_pydantic_lines(e)) from None
    lines = _semantic_lines(recipe)
    if lines:
        raise DtkError(*lines)
    return recipe


def load(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe; raises DtkError with every problem found."""
    return build(read_file(path), overrides)


def dump(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
