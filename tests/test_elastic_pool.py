"""An elastic `%%hvd --min-np` pool that grows and shrinks between cells (`%hvd resize N`, or
another `-np` on the next cell), through a real IPython shell and a real pool: the new rank
is spawned by MPI, registers with the pool's controller, runs the pool's earlier cells, and
gets the others' state by `sync()` in the next `hvd.elastic.run` call."""
from __future__ import annotations

import time

import pytest

psutil = pytest.importorskip("psutil")
from test_pool import pool_processes, wait_no_pool_processes  # noqa: E402

SETUP = '''
import torch
import hvd_magic.torch as hvd
N, BATCH = 48, 4
g = torch.Generator().manual_seed(0)
X = torch.randn(N, 8, generator=g)
Y = X @ torch.randn(8, 1, generator=g)
torch.manual_seed(1234 + hvd.rank())    # other weights on every rank: only sync() equals them
model = torch.nn.Linear(8, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, sampler=hvd.elastic.ElasticSampler(range(N), seed=1),
                               epoch=0, steps=[])
resets, unequal = [], []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])

@hvd.elastic.run
def train(state, epochs):
    while state.epoch < epochs:
        idx = list(state.sampler)
        for b in range(len(idx) // BATCH):
            w = torch.cat([p.detach().ravel() for p in model.parameters()]).tolist()
            if any(o != w for o in hvd.allgather_object(w, name="weights")):
                unequal.append((state.epoch, b, hvd.size()))
            mine = idx[b * BATCH:(b + 1) * BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X[mine]), Y[mine]).backward()
            opt.step()
            state.steps.append((state.epoch, hvd.allgather_object(mine, name="indices")))
            state.sampler.record_batch(b, BATCH)
            if b % 2 == 1:
                state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()
'''

REPLAY = '''
torch.manual_seed(1234)                 # rank 0's first weights, which the first sync spread
ref = torch.nn.Linear(8, 1)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
for _e, step in state.steps:
    ref_opt.zero_grad()
    sum(torch.nn.functional.mse_loss(ref(X[p]), Y[p]) for p in step).div(len(step)).backward()
    ref_opt.step()
once = all(sorted(i for ep, s in state.steps if ep == e for part in s for i in part)
           == list(range(N)) for e in range(3))
sizes = [len(s) for _e, s in state.steps]
same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(model.parameters(), ref.parameters()))
print(f"rank {hvd.rank()}: sizes {sorted(set(sizes))} each sample once {once} replay equal {same}")
'''


@pytest.fixture(scope="module")
def ip():
    from IPython.testing.globalipapp import get_ipython, start_ipython
    shell = start_ipython() or get_ipython()
    shell.run_line_magic("reload_ext", "hvd_magic")
    yield shell
    shell.run_line_magic("hvd", "stop")
    shell.run_line_magic("unload_ext", "hvd_magic")    # the next module's magics start afresh
    assert not wait_no_pool_processes(5.0)


ENGINE = "hvd_magic.kernel.ranks.engine"


def command(p):
    """``p``'s command line; empty when it has just exited (a rank that left the pool)."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def engines(want, timeout=5.0):
    """The pool's engine processes, once there are ``want`` of them (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [p for p in pool_processes() if command(p)[1:3] == ["-m", ENGINE]]
        if len(found) == want or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def cell(ip, capsys, line, code):
    res = ip.run_cell(f"%%hvd {line}\n{code}")
    got = capsys.readouterr()
    out = got.out + got.err            # the pool's status lines go to stderr
    assert res.success, (res.error_in_exec, out)
    return out


def test_an_elastic_pool_grows_at_resize_and_shrinks_at_another_np(ip, capsys):
    cell(ip, capsys, "-np 2 --min-np 1", SETUP + "train(state, 1)\nhvd.size(), len(state.steps)")
    ip.run_line_magic("hvd", "resize 3")
    out = capsys.readouterr().out
    assert "hvd: the pool grew from 2 to 3 ranks" in out, out
    assert len(engines(3)) == 3
    # the new rank ran the set-up cell (the training in it was skipped); train() syncs it
    out = cell(ip, capsys, "", "train(state, 2)\nhvd.rank(), hvd.size(), unequal, resets")
    for r, resets in ((0, "[3]"), (1, "[3]"), (2, "[]")):
        assert f"[{r}] Out: ({r}, 3, [], {resets})" in out, out
    # another -np on the next cell of the same elastic pool: ranks 2.. leave
    out = cell(ip, capsys, "-np 2 --min-np 1", "train(state, 3)\nhvd.rank(), hvd.size(), unequal, resets")
    assert "the pool shrank from 3 to 2 ranks (rank(s) 2 left)" in out, out
    for r in (0, 1):
        assert f"[{r}] Out: ({r}, 2, [], [3, 2])" in out, out
    assert len(engines(2)) == 2                 # the rank that left has exited
    out = cell(ip, capsys, "", REPLAY)
    for r in (0, 1):
        assert f"rank {r}: sizes [2, 3] each sample once True replay equal True" in out, out
    ip.run_line_magic("hvd", "status")
    assert "hvd pool: 2 ranks, running" in capsys.readouterr().out


def test_resize_on_a_fixed_pool_and_below_min_np_say_what_to_do(ip, capsys):
    cell(ip, capsys, "-np 2", "1")
    res = ip.run_cell("%hvd resize 3")
    assert "only an elastic pool (%%hvd --min-np M) changes size" in str(res.error_in_exec)
    cell(ip, capsys, "-np 2 --min-np 2", "1")
    res = ip.run_cell("%hvd resize 1")
    assert "the pool's --min-np is 2" in str(res.error_in_exec)
    res = ip.run_cell("%hvd resize x")
    assert "%hvd resize takes the number of ranks" in str(res.error_in_exec)


def test_a_new_rank_that_cannot_run_the_earlier_cells_leaves_again(ip, capsys):
    cell(ip, capsys, "-np 2 --min-np 1", "import os\nimport hvd_magic.collectives as hvd\n"
         "if hvd.rank() >= 2:\n    raise RuntimeError('data only the first ranks have')")
    res = ip.run_cell("%hvd resize 3")
    text = str(res.error_in_exec)
    assert "RuntimeError: data only the first ranks have" in text, text
    assert "the new rank(s) left again and the pool goes on with 2 ranks" in text, text
    out = cell(ip, capsys, "", "hvd.rank(), hvd.size()")
    assert "[1] Out: (1, 2)" in out and "[2]" not in out, out
