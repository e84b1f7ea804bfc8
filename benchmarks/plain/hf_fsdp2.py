"""Plain torch FSDP2 on a transformers GPT-2 built from its config: `fully_shard` per GPT2Block, then the root, on the
shared workload's data and optimizer. `torchrun --nproc-per-node 2 benchmarks/plain/hf_fsdp2.py --out r.json`."""
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

import workload as w

# Keep in step with benchmarks/hf.py's dtk overrides (dtk fills vocab and context from the data, use_cache off,
# and drops GPT-2's token ids, which lie outside this vocabulary).
GPT2 = {"n_layer": 4, "n_embd": 256, "n_head": 4}

args = w.parse_args()
w.init(args.backend)
mesh = init_device_mesh("cpu", (w.dist.get_world_size(),))
config = GPT2Config(**GPT2, vocab_size=w.VOCAB, n_positions=w.SEQ_LEN, use_cache=False, bos_token_id=None,
                    eos_token_id=None)
model = w.seeded(lambda: GPT2LMHeadModel(config))  # the same weights on every rank, and the same as dtk's
for block in model.transformer.h:
    fully_shard(block, mesh=mesh, reshard_after_forward=True)
fully_shard(model, mesh=mesh, reshard_after_forward=True)  # as dtk does: the root reshards too
optimizer = w.build_optimizer(model.parameters())


def step(x, y):
    loss = w.loss_fn(model(x).logits, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


w.train(step, args)
