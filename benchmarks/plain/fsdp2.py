"""Plain torch FSDP2 (`fully_shard` per block, then the root) on the shared workload, under torchrun."""
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import workload as w

args = w.parse_args()
w.init(args.backend)
mesh = init_device_mesh("cpu", (w.dist.get_world_size(),))
model = w.build_model()
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = w.build_optimizer(model.parameters())


def step(x, y):
    loss = w.loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


w.train(step, args)
