"""Process sets at any size: registered at init and at run time, disjoint sets reducing at
once, a set a rank is not in, roots and gathers in global ranks, unnamed calls numbered per
set, errors naming the set, removal, shutdown and init again. Values against references.

Exits nonzero with one line per failed check, prefixed by the rank."""
import os
import sys
import time
import traceback

import numpy as np
import torch

import hvd_magic.collectives as hvd

# Under torchrun (the gloo controller) there is no MPI: the sets made from MPI
# communicators (static_sets) run under mpiexec only.
TORCHRUN = "OMPI_COMM_WORLD_SIZE" not in os.environ and "RANK" in os.environ
if TORCHRUN:
    W = None
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
else:
    from mpi4py import MPI
    W = MPI.COMM_WORLD
    r, n = W.Get_rank(), W.Get_size()
FAILS = []


def check(ok, msg):
    if not ok:
        FAILS.append(msg)


def raises(fn, kind, *fragments):
    try:
        fn()
    except kind as e:
        for f in fragments:
            check(f in str(e), f"error lacks {f!r}: {e}")
        return str(e)
    except Exception as e:  # noqa: BLE001
        FAILS.append(f"expected {kind.__name__}, got {type(e).__name__}: {e}")
        return ""
    FAILS.append(f"expected {kind.__name__} containing {fragments}, nothing raised")
    return ""


def dynamic_sets():
    evens = [k for k in range(n) if k % 2 == 0]
    odds = [k for k in range(n) if k % 2 == 1]
    # not dynamic: adding is refused, with what to do
    hvd.init()
    raises(lambda: hvd.add_process_set(evens), ValueError, "HOROVOD_DYNAMIC_PROCESS_SETS=1")
    check(hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r,
          f"global set size/rank {hvd.global_process_set.size()}/{hvd.global_process_set.rank()}")
    hvd.shutdown()

    hvd.init(process_sets="dynamic")
    ev, od = hvd.add_process_set(evens), hvd.add_process_set(hvd.ProcessSet(odds))
    check((ev.process_set_id, od.process_set_id) == (1, 2), f"ids {ev.process_set_id}, {od.process_set_id}")
    mine, other = (ev, od) if r % 2 == 0 else (od, ev)
    mates = evens if r % 2 == 0 else odds
    check(mine.included() and not other.included(), "included()")
    check(mine.rank() == mates.index(r) and other.rank() is None, f"rank() {mine.rank()} {other.rank()}")
    check(mine.size() == len(mates) and other.size() == n - len(mates), "size()")
    raises(lambda: hvd.add_process_set(evens), ValueError, "exists already")

    # two disjoint sets reduce at once; each gets its own members' sum
    for step in range(5):
        got = hvd.allreduce(np.full(3, r + step, np.float64), op=hvd.Sum, process_set=mine)
        check(np.allclose(got, sum(k + step for k in mates)), f"set sum step {step}: {got}")
        t = hvd.allreduce(torch.full((2,), float(r)), process_set=mine)      # Average, torch
        check(torch.allclose(t, torch.full((2,), float(np.mean(mates)))), f"torch average {t}")
    # a set this rank is not in: refused here, naming the set and its ranks
    raises(lambda: hvd.allreduce(np.ones(2), process_set=other), ValueError,
           f"rank {r} is not in process set {other.process_set_id}", "included()")
    # allgather in set order; broadcast from a global root rank
    g = hvd.allgather(np.array([r]), process_set=mine)
    check(g.tolist() == mates, f"allgather {g.tolist()} != {mates}")
    root = mates[-1]
    b = hvd.broadcast(np.array([r, r]), root_rank=root, process_set=mine)
    check(b.tolist() == [root, root], f"broadcast from {root}: {b.tolist()}")
    o = hvd.broadcast_object({"from": r}, root_rank=root, process_set=mine)
    check(o == {"from": root}, f"broadcast_object {o}")
    check(hvd.allgather_object(r, process_set=mine) == mates, "allgather_object")
    if len(mates) < n:
        outsider = [k for k in range(n) if k not in mates][0]
        raises(lambda: hvd.broadcast(np.zeros(1), root_rank=outsider, process_set=mine), ValueError,
               f"root_rank={outsider} is not in process set {mine.process_set_id}")
    rs = hvd.reducescatter(np.arange(2 * len(mates), dtype=np.float32), op=hvd.Sum, process_set=mine)
    i = mates.index(r)
    check(np.allclose(rs, len(mates) * np.arange(2 * i, 2 * i + 2)), f"reducescatter {rs}")
    a = hvd.alltoall(np.full(len(mates), r), process_set=mine)
    check(a.tolist() == mates, f"alltoall {a.tolist()}")
    hvd.barrier(process_set=mine)

    # a mismatch inside a set: every member raises, naming global ranks and the set
    if len(mates) > 1:
        bad = np.zeros(2 + (r == mates[-1]))
        raises(lambda: hvd.allreduce(bad, name="ps.bad", process_set=mine), hvd.TensorMismatchError,
               "ps.bad", f"rank {mates[-1]} sent", f"(process set {mine.process_set_id})")
    hvd.allreduce(np.ones(1), process_set=hvd.global_process_set)    # the global set still works

    if n >= 3:
        overlapping(ev)
    check(hvd.remove_process_set(od) and hvd.remove_process_set(ev), "remove_process_set")
    check(not hvd.remove_process_set(ev) and not hvd.remove_process_set(hvd.global_process_set),
          "removing twice, or the global set, returns False")
    check(ev.process_set_id is None, "a removed set is invalidated")
    raises(lambda: hvd.allreduce(np.ones(1), process_set=ev), ValueError, "add_process_set")
    # sets still registered at shutdown end with it; init starts afresh
    last = hvd.add_process_set([0])
    check(last.process_set_id == (3 if n < 3 else 5), f"ids go on after removals: {last.process_set_id}")
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    check(hvd.add_process_set([0]).process_set_id == 1, "ids start again after init")
    hvd.shutdown()


def overlapping(b):
    """Sets {0, 1} and ``b`` = {0, 2}: rank 0 makes unnamed calls in both, ranks 1 and 2 in
    one each; a set whose ranks are all here never waits for a rank busy elsewhere."""
    a = hvd.add_process_set([0, 1])
    for step in range(3):
        if r in (0, 1):
            got = hvd.allreduce(np.array([1.0]), op=hvd.Sum, process_set=a)
            check(got[0] == 2, f"set a unnamed step {step}: {got}")
        if r in (0, 2):
            got = hvd.allreduce(np.array([2.0]), op=hvd.Sum, process_set=b)
            check(got[0] == 4, f"set b unnamed step {step}: {got}")
    # rank 0 sleeps; set {1, 2} completes meanwhile
    c = hvd.add_process_set([1, 2])
    if r == 0:
        time.sleep(2.0)
    else:
        t0 = time.monotonic()
        hvd.allreduce(np.ones(4), process_set=c)
        check(time.monotonic() - t0 < 1.5, f"set {{1, 2}} waited {time.monotonic() - t0:.1f} s for rank 0")
    for ps in (a, c):
        hvd.remove_process_set(ps)


def torch_face():
    """hvd_magic.torch with process_set=: values and gradients stay inside the set."""
    import hvd_magic.torch as th
    th.init(process_sets="dynamic")
    mates = [k for k in range(n) if k % 2 == r % 2]
    ev, od = th.add_process_set([k for k in range(n) if k % 2 == 0]), th.add_process_set(
        [k for k in range(n) if k % 2 == 1])
    mine = ev if r % 2 == 0 else od
    x = torch.full((3,), float(r), requires_grad=True)
    y = th.allreduce(x, op=th.Sum, process_set=mine)
    check(torch.allclose(y, torch.full((3,), float(sum(mates)))), f"torch set allreduce {y}")
    y.sum().backward()
    check(torch.allclose(x.grad, torch.full((3,), float(len(mates)))), f"allreduce grad {x.grad}")
    x = torch.full((r + 1, 2), float(r), requires_grad=True)
    g = th.allgather(x, process_set=mine)
    check(g.shape[0] == sum(k + 1 for k in mates), f"torch set allgather rows {g.shape}")
    (g * 2).sum().backward()      # each rank's rows get the set's averaged gradient (Horovod's rule)
    check(torch.allclose(x.grad, torch.full_like(x, 2.0)), f"allgather grad {x.grad}")
    b = th.broadcast(torch.full((2,), float(r)), root_rank=mates[0], process_set=mine)
    check(torch.allclose(b, torch.full((2,), float(mates[0]))), f"torch set broadcast {b}")
    rs = th.reducescatter(torch.ones(2 * len(mates)), None, th.Compression.none, th.Sum, mine)
    check(torch.allclose(rs, torch.full((2,), float(len(mates)))), f"reducescatter, Horovod's order {rs}")
    outs = th.grouped_allreduce([torch.ones(2), torch.ones(1)], op=th.Sum, process_set=mine)
    check(all(torch.allclose(o, torch.full_like(o, float(len(mates)))) for o in outs), "grouped")
    th.barrier(process_set=mine)
    # DistributedOptimizer(process_set=...): gradients averaged over the set only
    for op in (th.Average, th.Adasum):
        w = torch.nn.Parameter(torch.zeros(2))
        opt = th.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                      op=op, process_set=mine)
        (w * float(r)).sum().backward()              # gradient r on rank r
        opt.step()
        want = -float(np.mean(mates)) if op == th.Average else None
        if want is not None:
            check(torch.allclose(w.detach(), torch.full((2,), want)), f"set optimizer {w.detach()}")
        everyone = th.allgather_object(w.detach().tolist(), process_set=mine)
        check(all(e == everyone[0] for e in everyone), f"{op}: set ranks differ {everyone}")
    # outside the set: a plain local optimizer (as Horovod's)
    other = od if mine is ev else ev
    w = torch.nn.Parameter(torch.zeros(1))
    opt = th.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), process_set=other)
    (w * float(r + 1)).sum().backward()
    opt.step()
    check(torch.allclose(w.detach(), torch.tensor([-float(r + 1)])), f"local step outside the set {w}")
    th.remove_process_set(od)
    th.remove_process_set(ev)
    th.shutdown()


def static_sets():
    """hvd.init(process_sets=[...]): from ranks, and from communicators each rank is in."""
    sub = W.Split(color=r % 2, key=r)
    split = hvd.ProcessSet(sub)
    mates = [k for k in range(n) if k % 2 == r % 2]
    again = hvd.ProcessSet(mates)              # the same ranks as ``split``: invalidated
    whole = hvd.ProcessSet(list(range(n)))     # the global set's ranks: invalidated too
    pair = hvd.ProcessSet(reversed(range(1, n)))     # any iterable: ranks 1..n-1, sorted
    check(pair.ranks == list(range(1, n)), f"ProcessSet(reversed(range(1, n))).ranks {pair.ranks}")
    # duplicates raise, naming the entry, once the runtime and the other sets have started
    # (as Horovod's init)
    raises(lambda: hvd.init(process_sets=[split, again, whole] + ([pair] if n >= 3 else [])),
           ValueError, "process_sets entry number 1 is a duplicate", f"{mates}", "entry number 0")
    check(split.ranks == mates, f"set from a communicator: ranks {split.ranks} != {mates}")
    # ids follow rank 0's list, then the other ranks' new sets: {0, 2..} 1, then {1, 2} or {1}
    want = 1 if r % 2 == 0 else (3 if n >= 3 else 2)
    check(split.process_set_id == want, f"communicator set id {split.process_set_id} != {want}")
    check(again.process_set_id is None and whole.process_set_id is None, "a duplicate is invalidated")
    got = hvd.allreduce(np.array([float(r)]), op=hvd.Sum, process_set=split)
    check(got[0] == sum(mates), f"communicator set sum {got}")
    if n >= 3 and pair.included():
        got = hvd.allreduce(np.array([5.0]), op=hvd.Sum, process_set=pair)
        check(got[0] == 5.0 * len(pair.ranks), f"set from ranks at init: {got}")
    raises(lambda: hvd.add_process_set([0]), ValueError, "HOROVOD_DYNAMIC_PROCESS_SETS=1")
    hvd.shutdown()
    sub.Free()
    # an entry with the global set's ranks is a duplicate too; init(process_sets=) takes any
    # iterable of sets
    raises(lambda: hvd.init(process_sets=iter([hvd.ProcessSet(range(n))])), ValueError,
           "entry number 0 is a duplicate", "global process set")
    check(hvd.allreduce(np.array([1.0]), op=hvd.Sum)[0] == n, "the runtime runs after the error")
    hvd.shutdown()


try:
    for part in (dynamic_sets, torch_face) + (() if TORCHRUN else (static_sets,)):
        part()
except Exception:  # noqa: BLE001
    FAILS.append(traceback.format_exc())

for f in FAILS:
    print(f"[rank {r}] FAIL {f}", flush=True)
print("process_sets FAILED" if FAILS else "process_sets OK", flush=True)   # (one write: ranks share the pipe)
sys.exit(1 if FAILS else 0)
