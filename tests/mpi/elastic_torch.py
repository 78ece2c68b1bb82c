"""hvd.elastic.run under `mpiexec --with-ft ulfm`: the last rank SIGKILLs itself mid-epoch
(after a commit, with uncommitted steps done); the survivors restore the commit, go on with
one rank fewer and finish. Checked on rank 0 at the end: the epoch's samples were each
trained exactly once in what was committed; the final weights equal one process replaying the
same global batches; time from the kill to the first step after it.

usage: elastic_torch.py [E:B:R[:raise],...]   (prints 'elastic OK' on each surviving rank)
  each E:B:R: at epoch E, after B committed-or-not steps, the rank then numbered R is killed
  (with ":raise": its training function raises ValueError("bad batch") instead);
  default: 0:5:<last rank>"""
import os
import signal
import sys
import time

import torch

import hvd_magic.torch as hvd
from checklib import replay_fails

hvd.init()
N, BATCH, EPOCHS, COMMIT_EVERY = 96, 4, 2, 2
world = hvd.size()
KILLS = [tuple(int(x) if x.isdigit() else x for x in k.split(":")) for k in
         (sys.argv[1] if len(sys.argv) > 1 else f"0:5:{world - 1}").split(",")]
g = torch.Generator().manual_seed(0)
X, W_true = torch.randn(N, 8, generator=g), torch.randn(8, 1, generator=g)
Y = X @ W_true
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(N), shuffle=True, seed=1)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, steps=[])
marks = {}


@hvd.elastic.run
def train(state):
    while state.epoch < EPOCHS:
        idx = list(state.sampler)          # this rank's share of what the epoch has left
        for b in range(len(idx) // BATCH):
            for i, (e, b_kill, r, *how) in enumerate(KILLS):   # the i-th, at size world - i
                if (state.epoch, state.batch, hvd.rank(), hvd.size()) == (e, b_kill, r, world - i):
                    print(f"KILL {time.time():.3f}", flush=True)
                    if how == ["raise"]:
                        raise ValueError("bad batch")
                    os.kill(os.getpid(), signal.SIGKILL)
            if "lost" in marks and "resumed" not in marks:
                marks["resumed"] = time.time()
            mine = idx[b * BATCH:(b + 1) * BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X[mine]), Y[mine]).backward()
            opt.step()
            everyone = hvd.allgather_object(mine, name="indices")   # this step's global batch
            state.steps.append((state.epoch, everyone))
            state.batch += 1
            state.sampler.record_batch(b, BATCH)
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
        state.epoch, state.batch = state.epoch + 1, 0
        state.sampler.set_epoch(state.epoch)
        state.commit()


# the pause: a rank killed right after a reset can take its last stderr line (rank 0's "lost
# rank(s) ..." of the reset before) with it, before mpiexec has read it (seen once in CI)
state.register_reset_callbacks([lambda: marks.setdefault("lost", time.time()),
                                lambda: time.sleep(0.3)])
train(state)
fails = []
if hvd.size() != world - len(KILLS):
    fails.append(f"ended on {hvd.size()} ranks, not {world - len(KILLS)}")
fails += replay_fails(model, state.steps, X, Y, seed=0, epochs=EPOCHS)
if hvd.rank() == 0 and "resumed" in marks:
    print(f"RESUMED {marks['resumed']:.3f}", flush=True)
for f in fails:
    print(f"rank {hvd.rank()}: FAIL {f}", flush=True)
print("elastic OK" if not fails else "elastic FAILED", flush=True)
t = time.time()
hvd.shutdown()
print(f"shutdown {time.time() - t:.2f} s", flush=True)
sys.exit(1 if fails else 0)
