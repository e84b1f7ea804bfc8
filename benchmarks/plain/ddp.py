"""Plain torch DDP on the shared workload: `torchrun --nproc-per-node 2 benchmarks/plain/ddp.py --out r.json`."""
from torch.nn.parallel import DistributedDataParallel

import workload as w

args = w.parse_args()
w.init(args.backend)
model = DistributedDataParallel(w.build_model())
optimizer = w.build_optimizer(model.parameters())


def step(x, y):
    loss = w.loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


w.train(step, args)
