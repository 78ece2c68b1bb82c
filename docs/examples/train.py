"""The README's example as a script (/app/train.py in docs/examples/pytorchjob.yaml): the
same code runs under hvdrun (MPI) and under torchrun (torch.distributed), only the launcher
differs. Prints each rank's final weights as one JSON line."""
import json
import sys

import torch

import hvd_magic.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(10, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(1 + hvd.rank())
for step in range(10):
    x, y = torch.randn(32, 10, generator=gen), torch.randn(32, 1, generator=gen)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
weights = [p.detach().flatten().tolist() for p in model.parameters()]
# one write per line: the ranks of a host share its stdout, and print() may write the line
# and its newline separately, letting another rank's line in between
sys.stdout.write(json.dumps({"rank": hvd.rank(), "size": hvd.size(),
                             "local_rank": hvd.local_rank(), "cross_rank": hvd.cross_rank(),
                             "weights": weights}) + "\n")
sys.stdout.flush()
