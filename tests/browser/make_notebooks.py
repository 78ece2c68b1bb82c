"""Writes the notebooks used by tests/test_browser.py and notebooks/quickstart.ipynb
(``python tests/browser/make_notebooks.py``); the .ipynb files are committed."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def nb(cells):
    return {"cells": [{"cell_type": kind, "id": f"cell-{i}", "metadata": {},
                       "source": src.strip("\n").splitlines(True),
                       **({"execution_count": None, "outputs": []} if kind == "code" else {})}
                      for i, (kind, src) in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                        "name": "python3"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


TRAIN = '''
%%hvd -np 2
import time, sys, torch
import hvd_magic.torch as hvd
from hvd_magic.widgets import report
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(64, 64), torch.randn(64, 1)
for step in range(1, STEPS + 1):      # the same count on every rank (a time limit would not be)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    time.sleep(0.002)          # stands in for data loading
    report(samples=64)
    if step % 200 == 0:
        print(f"step {step} loss {loss.item():.4f}")
    if step % 1000 == 0:
        print(f"rank {hvd.rank()} note at step {step}", file=sys.stderr)
print(f"rank {hvd.rank()} finished {step} steps")
'''

LIVE = nb([
    ("code", "%load_ext hvd_magic\n"),
    ("code", TRAIN.replace("STEPS", "1800")),
])

QUICK = nb([
    ("markdown", "# hvd_magic quickstart\n\n`%load_ext hvd_magic`, then `%%hvd -np 2` runs a cell "
                 "on 2 MPI ranks. In JupyterLab each `%%hvd` cell shows a live panel: a log lane "
                 "per rank, status badges, throughput and scaling efficiency (from "
                 "`hvd_magic.report(samples=n)`), and a timeline of the collectives."),
    ("code", "%load_ext hvd_magic\n"),
    ("markdown", "## A collective on every rank"),
    ("code", '''
%%hvd -np 2
import numpy as np
import hvd_magic.collectives as hvd
x = np.full(4, float(hvd.rank()))
print("rank", hvd.rank(), "of", hvd.size(), "->", hvd.allreduce(x))   # average of 0 and 1
'''),
    ("markdown", "## Tiny data-parallel training with `hvd_magic.torch`"),
    ("code", '''
%%hvd -np 2
import torch
import hvd_magic.torch as hvd
from hvd_magic.widgets import report
torch.manual_seed(0)
model = torch.nn.Linear(10, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
g = torch.Generator().manual_seed(hvd.rank())        # each rank its own shard
w_true = torch.arange(10.0)
for step in range(200):
    x = torch.randn(32, 10, generator=g)
    y = x @ w_true + 0.01 * torch.randn(32, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
    loss.backward()
    opt.step()
    report(samples=32)
    if step % 50 == 0 or step == 199:
        print(f"step {step:3d} loss {loss.item():.4f}")
'''),
    ("markdown", "Both ranks end with the same weights (the gradients were averaged):"),
    ("code", '''
%%hvd
w = model.weight.detach().flatten()
print(hvd.rank(), hvd.allreduce(w, op=hvd.Max).sub(hvd.allreduce(w, op=hvd.Min)).abs().max().item())
'''),
    ("code", "%hvd stop\n"),
])

if __name__ == "__main__":
    (HERE / "live.ipynb").write_text(json.dumps(LIVE, indent=1) + "\n")
    (ROOT / "notebooks" / "quickstart.ipynb").write_text(json.dumps(QUICK, indent=1) + "\n")
    print("wrote", HERE / "live.ipynb", ROOT / "notebooks" / "quickstart.ipynb")
