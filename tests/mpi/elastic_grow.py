"""hvd.elastic.run growing and shrinking at commits, under `hvdrun --min-np 1 --max-np 3
--host-discovery-script S` started at 2 ranks: S prints the file SLOTS. In epoch 0 after 6
steps rank 0 writes 3 slots there: at the next commit a third rank is spawned and joins; in
epoch 1 after 4 steps, 2 slots: rank 2 leaves. Checked at every step: all ranks hold the same
weights before it (a joined rank too, before its first step); at the end, on the two ranks
left: every sample of each epoch trained exactly once, and the weights equal one process
replaying the same global batches. Each rank seeds its model differently, so equal weights
come of the syncs, not of equal seeds.

usage: elastic_grow.py SLOTS   (prints 'elastic OK' on each rank left; 'JOINED' on a new rank)"""
import sys
import time

import torch

import hvd_magic.torch as hvd
from checklib import replay_fails

hvd.init()
SLOTS = sys.argv[1]
N, BATCH, EPOCHS, COMMIT_EVERY = 96, 4, 2, 2
CHANGES = {(0, 6): 3, (1, 4): 2}      # (epoch, steps done) -> slots the script lists next
joined = hvd.size() == 3              # only a spawned rank starts with 3
if joined:
    print(f"JOINED as rank {hvd.rank()}", flush=True)
g = torch.Generator().manual_seed(0)
X, W_true = torch.randn(N, 8, generator=g), torch.randn(8, 1, generator=g)
Y = X @ W_true
torch.manual_seed(1234 + hvd.rank() + 10 * joined)
model = torch.nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(N), shuffle=True, seed=1)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, steps=[])
fails = []


@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        idx = list(state.sampler)
        for b in range(len(idx) // BATCH):
            weights = torch.cat([p.detach().ravel() for p in model.parameters()]).tolist()
            everyone = hvd.allgather_object(weights, name="weights")
            if any(w != weights for w in everyone):
                fails.append(f"epoch {state.epoch} step {state.batch} at {hvd.size()} ranks: "
                             f"the ranks' weights differ before the step")
            mine = idx[b * BATCH:(b + 1) * BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X[mine]), Y[mine]).backward()
            opt.step()
            state.steps.append((state.epoch, hvd.allgather_object(mine, name="indices")))
            state.batch += 1
            state.sampler.record_batch(b, BATCH)
            if state.batch % COMMIT_EVERY == 0:
                slots = CHANGES.get((state.epoch, state.batch))
                if slots and hvd.rank() == 0:
                    with open(SLOTS, "w") as fh:
                        fh.write(f"localhost:{slots}\n")
                    time.sleep(1.1)        # the script is asked at most once a second
                state.commit()
        state.epoch, state.batch = state.epoch + 1, 0
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(state)
if hvd.size() != 2:
    fails.append(f"ended on {hvd.size()} ranks, not 2")
sizes = [len(step) for _e, step in state.steps]
if 3 not in sizes:
    fails.append(f"never trained on 3 ranks: {sizes}")
# rank 0's first weights, which the first sync spread
fails += replay_fails(model, state.steps, X, Y, seed=1234, epochs=EPOCHS)
for f in fails:
    print(f"rank {hvd.rank()}: FAIL {f}", flush=True)
print("elastic OK" if not fails else "elastic FAILED", flush=True)
hvd.shutdown()
sys.exit(1 if fails else 0)
