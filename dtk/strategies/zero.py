"""DeepSpeed ZeRO stages 1, 2, 3 on the seam. A plain torch optimizer is handed to DeepSpeed (no JIT-built Adam),
gradient clipping is off unless the recipe asks (DeepSpeed clips at 1.0 by default), fp16 is not offered."""
from __future__ import annotations

import logging
import math
import os

import torch

from dtk.recipe import Recipe
from dtk.strategies import zero_checkpoint
from dtk.strategies.base import (BuildContext, build_torch_optimizer, loss_fn, materialize_optimizer_state,
                                 optimizer_tensors, prepare_blocks)


def _quiet_deepspeed() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _number_modules_from_zero() -> None:
    """ZeRO-3 numbers the modules it hooks (their ds_id, the keys of its module trace, checked across ranks) with
    a counter that is the mutable default argument of DeepSpeedZeRoOffload._register_deepspeed_module
    (`count=[0]`): it lives as long as the process, so a process's second engine numbers its modules after the
    first one's. A shadow that rehearsed a build then traced under ids shifted by one model's count and failed the
    cross-rank check. Every build starts the count (and that of zero.Init's parameter ids) from 0, as a fresh
    process does."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0
    Init.param_id = 0


class ZeroEngine:
    def __init__(self, ctx: BuildContext, *, stage: int):
        _quiet_deepspeed()
        import deepspeed

        r = ctx.recipe
        self.stage, self.rank, self.world = stage, ctx.group.rank(), ctx.group.size()
        self.abandons_forward = stage < 3
        """ZeRO-1/2's forward is the model's alone (ZeRO-3's gathers parameters and records its trace in it)."""
        self.bf16 = r.training.precision == "bf16"
        # On CPU, DeepSpeed's comm backend JIT-builds a shared-memory all-reduce (~40 s cold; rebuilt whenever a
        # process with another ninja version touched the cache) that only its inference path uses and that would
        # bypass the seam. Marking it incompatible makes init_distributed skip the build.
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="dtk", dist_init_required=False)
        config = deepspeed_config(r, stage=stage)
        model = prepare_blocks(_model(ctx, stage=stage, config=config), r)
        optimizer = build_torch_optimizer(model, r.optimizer)
        if stage == 3:
            _number_modules_from_zero()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.module = self.engine.module
        self._buckets: list[list[tuple[int, int]]] | None = None
        """resilience.roll_forward (ZeRO-3): each reduce-scatter of this step, as (ds_id, bytes) of the parameters
        whose partitions lie back to back in its output; None: not recorded."""
        self._comm_dtypes: set[torch.dtype] = set()
        self._square_total: float | None = None
        if stage == 3 and r.resilience.roll_forward:
            self._arm_roll_forward()

    def forward_backward(self, x, y, *, last_micro: bool) -> torch.Tensor:
        if self.bf16 and x.is_floating_point():
            x = x.to(torch.bfloat16)
        loss = loss_fn(self.engine(x), y)
        self.engine.backward(loss)  # DeepSpeed scales by 1/grad_accum itself
        if not last_micro:
            self.engine.step()  # only counts the micro-step; the update waits for optimizer_step()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.engine.step()
        self._square_total = None

    def discard_step(self) -> None:
        self._square_total = None
        if self._buckets is not None:
            self._buckets = []
        self.engine.zero_grad()
        # ZeRO keeps reduced gradients in its own partitions and accumulates into them after the first micro-step:
        # reset that too, and the engine's micro-step count to the step's start, or the redone step adds to the
        # failed one's gradients
        self.optimizer.zero_grad(set_to_none=True)
        self.engine.micro_steps -= self.engine.micro_steps % self.engine.gradient_accumulation_steps()
        if self.stage == 3:
            # A failed step leaves ZeRO-3 mid-way: parameters gathered, its module trace half recorded. Release them
            # and forget the trace, so every rank, a joining one included, records it afresh in the same order (its
            # cross-rank checks are collectives: a rank that skipped them would wait for the others forever).
            offload = self.optimizer.parameter_offload
            offload.empty_partition_cache()
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()

    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups  # DeepSpeed's ZeRO optimizer hands out its torch optimizer's groups

    def grad_square_share(self) -> float | None:
        if self._buckets is None:
            return None  # the gradients sit in DeepSpeed's partitions; its step measures the norm
        grads = [g for part in self.optimizer.averaged_gradients.values() if part for g in part]
        return float(torch.stack([g.float().square().sum() for g in grads]).sum()) if grads else 0.0

    def note_grad_square_total(self, total: float) -> None:
        """The trainer's sum of every rank's grad_square_share: the norm this step's update uses."""
        self._square_total = total

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def _flat_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        opt = self.optimizer
        if self.stage == 3:
            return list(opt.fp16_partitioned_groups_flat), list(opt.fp32_partitioned_groups_flat)
        return list(opt.bit16_groups_flat), list(opt.single_partition_of_fp32_groups)

    def local_state(self) -> list[torch.Tensor]:
        low, master = self._flat_groups()
        if self.stage == 3:
            self._materialize_stage3(master)
        else:
            materialize_optimizer_state(self.optimizer.optimizer)
        return low + master + optimizer_tensors(self.optimizer.optimizer, master)

    def protected_state(self) -> list[torch.Tensor]:
        """local_state() without the low-precision parameters: no peer's parity need hold what the master
        partitions make again (rebuild_replicated)."""
        low, master = self._flat_groups()
        self.local_state()  # creates the optimizer state of a fresh engine
        return master + optimizer_tensors(self.optimizer.optimizer, master)

    def rebuild_replicated(self) -> None:
        """Collective: the low-precision parameters from the master partitions, as DeepSpeed's step makes them
        (ZeRO-1/2: cast my partition, then all-gather every rank's; ZeRO-3: cast my partition)."""
        opt = self.optimizer
        with torch.no_grad():
            if self.stage == 3:
                for low, master in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
                    low.copy_(master)
                return
            from deepspeed.runtime.utils import all_gather_dp_groups

            for i, master in enumerate(opt.single_partition_of_fp32_groups):
                me = torch.distributed.get_rank(group=opt.real_dp_process_group[i])
                opt.parallel_partitioned_bit16_groups[i][me].copy_(master)
            all_gather_dp_groups(groups_flat=opt.bit16_groups_flat,
                                 partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                                 dp_process_group=opt.real_dp_process_group,
                                 start_alignment_factor=opt.nccl_start_alignment_factor,
                                 allgather_bucket_size=opt.allgather_bucket_size)
            for i in range(len(opt.bit16_groups)):
                opt._update_model_bit16_weights(i)

    # -- resilience.roll_forward (ZeRO-3): a lost rank's update, made again from its reduced gradients --
    def _arm_roll_forward(self) -> None:
        """ZeRO-3's update needs no peer but for DeepSpeed's all-reduce of the gradient norm, which only clipping
        (refused with roll forward) and its non-finite check use: that norm becomes the trainer's gathered one
        (grad_square_share), so the survivors of a rank lost in its update commit the update. Every reduce-scatter's
        parameters are recorded, for seal (reduced_keys). Both hooks are on this engine's optimizer only."""
        opt = self.optimizer
        scatter = opt._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads  # (private: the hook a bucket passes)
        own_norms = opt._get_norm_groups
        self._buckets = []

        def recorded(params, communication_data_type):
            if self._buckets is not None:  # the output holds each parameter's padded partition, in this order
                size = torch.empty((), dtype=communication_data_type).element_size()
                self._buckets.append([(p.ds_id, p.partition_numel() * size) for p in params])
                self._comm_dtypes.add(communication_data_type)
            return scatter(params, communication_data_type)

        def gathered_norms():
            if self._square_total is None:  # no gathered norm this step: DeepSpeed's own (a collective)
                return own_norms()
            return [torch.tensor(math.sqrt(self._square_total), dtype=torch.float32) * opt.loss_scale]

        opt._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads = recorded
        opt._get_norm_groups = gathered_norms

    def reduced_keys(self) -> list[list[tuple[int, int]]] | None:
        """After the step's last backward: this step's reduce-scatters, each as (ds_id, bytes) of the partitions
        its output holds back to back (the same on every rank); None when the update cannot be made from them."""
        buckets, self._buckets = self._buckets, ([] if self._buckets is not None else None)
        dtypes, self._comm_dtypes = self._comm_dtypes, set()
        opt = self.optimizer
        # (reduced in the dtype they accumulate in, and not rescaled after: the bytes are the gradients as kept)
        if (buckets is None or opt.offload_optimizer or opt.gradient_predivide_factor != 1.0
                or dtypes - {opt.gradient_accumulation_dtype}):
            return None
        return buckets

    def update_alone(self, chunks: list[tuple[int, torch.Tensor]]) -> None:
        """This rank's update from its reduced partitions (`chunks`: (ds_id, the padded partition's bytes), in
        reduce order), with no peer: DeepSpeed's own steps for each sub-group (partition_grads' copy, or add on a
        later micro-step; the flat fp32 gradient; the unscale; the torch optimizer; the copy to the model's
        partitions), less the norm, which only clipping uses."""
        opt = self.optimizer
        buffers = opt._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        params = {p.ds_id: p for group in opt.fp16_groups for p in group}
        written: set[int] = set()
        with torch.no_grad():
            for ds_id, raw in chunks:
                p = params[ds_id]
                part = p.partition_numel()
                real = max(0, min(part, p.ds_numel - part * self.rank))  # the last ranks' partitions hold padding
                if real == 0:
                    continue
                grad = raw.view(opt.gradient_accumulation_dtype)[:real]
                target = buffers[ds_id].narrow(0, 0, real)
                target.add_(grad) if ds_id in written else target.copy_(grad)
                written.add(ds_id)
            opt._pre_step()
            for i, group in enumerate(opt.fp16_groups):
                opt.averaged_gradients[i] = [buffers[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor)
                                             for p in group]
            names: set = set()
            for i in range(len(opt.fp16_groups)):
                opt._prepare_sub_group(i, names)
                opt.unscale_and_clip_grads(i, None)
                opt._optimizer_step(i)
                opt._reassign_or_swap_out_partitioned_parameters(i)
                opt._release_sub_group(i, names)

    def match_running_layout(self, x, y) -> None:
        pass  # a joining ZeRO-3 engine starts with no parameter trace; so do the others after a failure (discard_step)

    def _materialize_stage3(self, master: list[torch.Tensor]) -> None:
        """ZeRO-3 hands its fp32 partitions to the torch optimizer only inside its step (param_groups are empty
        otherwise), so a fresh engine's state would lack the optimizer tensors until the first update: point the
        groups at the partitions for the dry step, then put back what DeepSpeed had (params lists, grad buffers)."""
        opt = self.optimizer.optimizer
        if all(opt.state.get(f) for f in master):
            return
        params, grads = [g["params"] for g in opt.param_groups], [f.grad for f in master]
        for g in opt.param_groups:
            g["params"] = []
        for sub, f in enumerate(master):
            opt.param_groups[self.optimizer.sub_group_to_group_id[sub]]["params"].append(f)
            f.grad = None
        try:
            materialize_optimizer_state(opt)
        finally:
            for g, ps in zip(opt.param_groups, params):
                g["params"] = ps
            for f, grad in zip(master, grads):
                f.grad = grad

    def checkpoint_state(self) -> dict:
        return zero_checkpoint.state(self)  # per-parameter slices: resumes on another rank count, or another stage

    def after_checkpoint_load(self, state: dict) -> None:
        zero_checkpoint.after_load(self, state)


def deepspeed_config(r: Recipe, *, stage: int) -> dict:
    """DeepSpeed's config for a recipe: what dtk sets, and why, where DeepSpeed's defaults would differ from the
    other strategies (clipping, traffic, bucket memory)."""
    bf16 = r.training.precision == "bf16"
    # Gradient and all-gather buckets of strategy.bucket_mb, like DDP's, in the dtype DeepSpeed communicates (the
    # model's). DeepSpeed's default, 5e8 elements (2 GB in fp32) whatever the model, is a buffer the first step
    # fills with every gradient of a model up to that size, plus as much again to reduce it: measured on a 302M
    # GPT, 2 ranks, it was 2.5 of the model's 4 bytes per parameter on each rank (BENCHMARKS.md). A bucket size
    # changes which gradients are reduced together, not the sum of each element.
    bucket = max(1, int(r.strategy.bucket_mb * 2**20) // (2 if bf16 else 4))
    zero: dict = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage in (1, 2):
        # Textbook ZeRO-1/2 traffic (2 x params per step): each gradient partition is reduced to its owner
        # instead of all-reducing whole buckets (DeepSpeed's default, 3 x params). Measured on gloo, 2 ranks,
        # a 3.2M-parameter GPT: steps/s the same within noise (BENCHMARKS.md).
        zero["use_multi_rank_bucket_allreduce"] = False
    if stage == 3:
        # Textbook ZeRO-3 (3 x params moved per step): no parameter stays whole for being small, and none is
        # kept gathered from forward to backward. DeepSpeed's defaults trade memory for traffic on both.
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
        # The optimizer steps the partition in sub-groups of about a bucket, not in one (DeepSpeed's 1e9 elements):
        # AdamW's temporaries are the size of what one step call updates. Measured on the 302M GPT, 2 ranks: the
        # first step's peak fell from 4.12 to 2.69 of the model per rank. Per element the update is the same.
        zero["sub_group_size"] = bucket
    if r.strategy.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": r.training.micro_batch,
        "gradient_accumulation_steps": r.training.grad_accum,
        "gradient_clipping": r.optimizer.grad_clip,
        "zero_optimization": zero,
        # bf16 weights and gradients, fp32 master partitions in the optimizer (fp16 is refused on CPU)
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }


def _model(ctx: BuildContext, *, stage: int, config: dict):
    """ZeRO-3 with a blueprint builds the model inside deepspeed.zero.Init: each module's parameters are
    partitioned as soon as the module is built, so a rank never holds the whole model; then each rank fills its
    partitions with the values a full build gives (dtk.models.init). Otherwise the whole model, on the device."""
    if stage != 3 or ctx.blueprint is None:
        return ctx.model_factory().to(ctx.device)
    import deepspeed

    twin = ctx.blueprint.meta()
    # The dtype comes from the config (bf16 or fp32). An explicit dtype= is not what it says: DeepSpeed 0.19 reads
    # it as `dtype or fp16 if the device supports fp16 else bf16`, so on CPU dtype=torch.float32 gave bf16 weights
    with deepspeed.zero.Init(data_parallel_group=ctx.group, config_dict_or_path=config):
        model = ctx.blueprint.build()  # (drawing nothing for a replacement: Blueprint.blank)
    ctx.blueprint.fill(model, twin=twin)
    return model


def build(ctx: BuildContext, *, stage: int) -> ZeroEngine:
    return ZeroEngine(ctx, stage=stage)
