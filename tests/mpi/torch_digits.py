"""A Horovod-style training script (only the import differs from horovod.torch): an MLP on
scikit-learn's 8x8 digits (bundled, nothing downloaded), each rank on its shard.

Usage: mpiexec -n 2 python torch_digits.py CHECKPOINT_DIR
Prints "accuracy <test accuracy>" on rank 0 and "checkpoint written by rank <r>" where saved.
"""
import os
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hvd_magic.torch as hvd

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)
ckpt_dir = sys.argv[1]

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
train_idx, test_idx = perm[:1400], perm[1400:]
# each rank trains on its own shard
mine = train_idx[hvd.rank()::hvd.size()]
X_train, y_train = X[mine], y[mine]

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)   # lr scaled by size
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

batch = 32
for epoch in range(10):
    order = torch.randperm(len(X_train), generator=torch.Generator().manual_seed(epoch))
    steps = len(X_train) // batch          # equal on every rank (shards differ by at most one)
    for s in range(steps):
        idx = order[s * batch:(s + 1) * batch]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X_train[idx]), y_train[idx])
        loss.backward()
        optimizer.step()
    avg_loss = hvd.allreduce(loss.detach(), name="avg_loss")
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                   os.path.join(ckpt_dir, "checkpoint.pt"))
        print(f"checkpoint written by rank {hvd.rank()} epoch {epoch} loss {avg_loss.item():.4f}",
              flush=True)

with torch.no_grad():
    part = test_idx[hvd.rank()::hvd.size()]
    correct = (model(X[part]).argmax(1) == y[part]).sum()
    counts = hvd.allreduce(torch.tensor([float(correct), float(len(part))]), op=hvd.Sum)
if hvd.rank() == 0:
    print(f"accuracy {(counts[0] / counts[1]).item():.4f}", flush=True)
hvd.shutdown()
