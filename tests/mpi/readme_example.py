"""The README's example as a script (hvd.init() added, inputs seeded by rank so runs can be
compared): prints rank 0's weights after training as ``weights [...]``."""
import sys

import torch

import hvd_magic.torch as hvd

hvd.init()
torch.manual_seed(1000 + hvd.rank())
torch.set_num_threads(1)

model = torch.nn.Linear(10, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(10):
    x, y = torch.randn(32, 10), torch.randn(32, 1)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(f"rank {hvd.rank()}: loss {loss.item():.3f}", flush=True)
if hvd.rank() == 0:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    sys.stdout.write(f"weights {[float.hex(v) for v in flat]}\n")
    sys.stdout.flush()
hvd.shutdown()
