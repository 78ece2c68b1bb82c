"""hvd.elastic.run growing onto a host the discovery script adds, under `hvdrun -np 1
--min-np 1 --max-np 2 -H A:1 --host-discovery-script S` on two namespace hosts: S prints the
file SLOTS, which lists host A alone until rank 0 adds host B after 4 steps. The rank that
joins must run on B; both ranks hold the same weights before every step; each rank ends by
printing `RANK {json}` (its host, rank, size, the steps it saw at 2 ranks, the weights' sum).

usage: elastic_hosts.py SLOTS HOST_B   (HOST_B as the script lists it)"""
import json
import socket
import sys
import time

import torch

import hvd_magic.torch as hvd

hvd.init()
SLOTS, HOST_B = sys.argv[1], sys.argv[2]
torch.manual_seed(1234 + hvd.rank() + 10 * (hvd.size() == 2))   # only a joined rank sees 2
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)
unequal = []


@hvd.elastic.run
def train(state):
    while state.step < 12:
        w = [float(v) for p in model.parameters() for v in p.detach().ravel()]
        if any(o != w for o in hvd.allgather_object(w, name="weights")):
            unequal.append(state.step)
        opt.zero_grad()
        model(torch.ones(2, 4) * (hvd.rank() + 1)).sum().backward()
        opt.step()
        state.step += 1
        if state.step == 4 and hvd.rank() == 0:
            with open(SLOTS, "a") as fh:
                fh.write(f"{HOST_B}:1\n")
            time.sleep(1.1)        # the script is asked at most once a second
        if state.step % 2 == 0:
            state.commit()


train(state)
print("RANK " + json.dumps({"host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
                            "unequal": unequal, "step": state.step,
                            "sum": float(sum(p.sum() for p in model.parameters()))}), flush=True)
