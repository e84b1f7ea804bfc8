"""Plain DeepSpeed ZeRO-2 (`--stage 3` for ZeRO-3) on the shared workload, under torchrun: a torch AdamW handed
to DeepSpeed (no JIT-built Adam), gradient_clipping 0 (DeepSpeed clips at 1.0 by default)."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402

import workload as w  # noqa: E402

args = w.parse_args({"--stage": {"type": int, "choices": [1, 2, 3], "default": 2}})
w.init(args.backend)
deepspeed.init_distributed(dist_backend=args.backend, dist_init_required=False)
zero = {"stage": args.stage}
if args.stage in (1, 2):  # as dtk's zero1/zero2: each gradient partition reduced to its owner (2 x params moved)
    zero["use_multi_rank_bucket_allreduce"] = False
if args.stage == 3:  # the same textbook ZeRO-3 as dtk's zero3: nothing kept whole or gathered between passes
    zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
config = {
    "train_micro_batch_size_per_gpu": w.MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": zero,
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "steps_per_print": 1 << 30,
}
model = w.build_model()
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=w.build_optimizer(model.parameters()), config=config)


def step(x, y):
    loss = w.loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss


w.train(step, args)
# ZeRO-3 can abort in interpreter teardown after a finished run; the result is written, so leave now.
os._exit(0)
