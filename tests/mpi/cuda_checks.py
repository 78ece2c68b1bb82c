"""CUDA tensors through hvd_magic.torch, run by tests/test_cuda.py and benchmarks/gpu_check.sh.

    cuda_checks.py collectives|optimizer|timeline [--device cuda|cpu]

``collectives``: allreduce (Sum, Average, Min, Max; out of place, in place, async), grouped
allreduce, allgather, broadcast, alltoall and reducescatter in float32, float16 and bfloat16;
every result must hold the expected values and stay on the input tensor's device.
``optimizer``: DistributedOptimizer trains a small CNN, each rank on its share of every
batch, to the weights one process reaches on the whole batches; broadcast_optimizer_state
gives every rank rank 0's Adam state (CUDA tensors and a CPU step count).
``timeline``: a few training steps with ``HOROVOD_TIMELINE`` set by the caller; the test
reads the file afterwards.

At 1 rank CUDA tensors take torch.distributed with NCCL; at 2 ranks on one GPU NCCL cannot
run (it refuses two ranks on the same device), so they must go through host memory.
``--device cpu`` runs the same checks on CPU tensors: the test and benchmarks/gpu_check.sh
use it to exercise this script where there is no GPU (with HOROVOD_CPU_OPERATIONS=gloo at
1 rank, CPU tensors take the torch.distributed code that NCCL runs on a GPU).

Prints ``CHECK <name> ok`` per passed check on rank 0; exits nonzero with one line per failed
check, prefixed by the rank (tests/mpi/checklib.py)."""
import argparse
import os

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import torch  # noqa: E402

import hvd_magic.torch as hvd  # noqa: E402
from checklib import FAILS, finish  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("what", choices=["collectives", "optimizer", "timeline"])
p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
ARGS = p.parse_args()

hvd.init()
R, N = hvd.rank(), hvd.size()
if ARGS.device == "cuda":
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    DEV = torch.device("cuda", torch.cuda.current_device())
else:
    DEV = torch.device("cpu")
    torch.set_num_threads(1)


def check(name):
    """Run one check; a failure (or exception) is recorded, a pass printed by rank 0."""
    def deco(fn):
        before = len(FAILS)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            FAILS.append(f"{name}: raised {type(exc).__name__}: {exc}")
        if len(FAILS) == before and R == 0:
            print(f"CHECK {name} ok", flush=True)
        return fn
    return deco


def expect(label, got, want, atol=0.0):
    """``got`` must be a tensor on DEV of ``want``'s dtype and shape, with ``want``'s values
    (``want``: a CPU tensor)."""
    if not isinstance(got, torch.Tensor):
        FAILS.append(f"{label}: got {type(got).__name__}, not a tensor")
    elif got.device != DEV:
        FAILS.append(f"{label}: result on {got.device}, the input was on {DEV}")
    elif got.dtype != want.dtype or got.shape != want.shape:
        FAILS.append(f"{label}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}")
    elif not torch.allclose(got.cpu().double(), want.double(), atol=atol, rtol=0):
        diff = (got.cpu().double() - want.double()).abs().max().item()
        FAILS.append(f"{label}: max diff {diff:.3g} > {atol}")


def on_dev(t):
    """A copy of ``t`` on DEV (``t.to("cpu")`` would be ``t`` itself, and an in-place
    collective would then change the reference values)."""
    return t.to(DEV, copy=True)


# ---------------------------------------------------------------- collectives
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def values(rank, n, dtype):
    """Halves in [-10, 10]: exact in float16 and bfloat16, sums of 2 ranks too."""
    i = torch.arange(n, dtype=torch.float64)
    return (((i * 7 + rank * 5) % 21 - 10) / 2).to(dtype)


def collectives():
    n = 1000
    for dt in DTYPES:
        tag = str(dt).replace("torch.", "")
        mine = values(R, n, dt)
        every = torch.stack([values(r, n, dt).double() for r in range(N)])
        # Average of halves is a multiple of 1/(2N): exact in these dtypes at 1 and 2 ranks
        want = {"Sum": every.sum(0), "Average": every.mean(0), "Min": every.min(0).values,
                "Max": every.max(0).values}
        ops = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max}

        @check(f"allreduce {tag}")
        def _():
            for op_name, op in ops.items():
                expect(f"allreduce {op_name} {tag}", hvd.allreduce(on_dev(mine), op=op,
                       name=f"ar.{op_name}.{tag}"), want[op_name].to(dt))
            t = on_dev(mine)
            out = hvd.allreduce_(t, op=hvd.Sum, name=f"ar_.{tag}")
            if out is not t:
                FAILS.append(f"allreduce_ {tag}: did not return the tensor it was given")
            expect(f"allreduce_ {tag}", t, want["Sum"].to(dt))
            h = hvd.allreduce_async(on_dev(mine), op=hvd.Average, name=f"ar_async.{tag}")
            expect(f"allreduce_async {tag}", hvd.synchronize(h), want["Average"].to(dt))
            expect(f"allreduce postscale {tag}",
                   hvd.allreduce(on_dev(mine), op=hvd.Sum, postscale_factor=0.5, name=f"ar.post.{tag}"),
                   (want["Sum"] * 0.5).to(dt))

        @check(f"grouped_allreduce {tag}")
        def _():
            parts = [mine[:10], mine[10:300], mine[300:]]
            outs = hvd.grouped_allreduce([on_dev(x) for x in parts], op=hvd.Sum, name=f"grouped.{tag}")
            for k, (o, lo, hi) in enumerate(zip(outs, (0, 10, 300), (10, 300, n))):
                expect(f"grouped_allreduce part {k} {tag}", o, want["Sum"][lo:hi].to(dt))

        @check(f"allgather {tag}")
        def _():
            # rank r gives r + 1 rows of 3 values r
            rows = torch.full((R + 1, 3), float(R), dtype=dt)
            want_ = torch.cat([torch.full((r + 1, 3), float(r), dtype=dt) for r in range(N)])
            expect(f"allgather {tag}", hvd.allgather(on_dev(rows), name=f"ag.{tag}"), want_)

        @check(f"broadcast {tag}")
        def _():
            for root in range(N):
                expect(f"broadcast root {root} {tag}",
                       hvd.broadcast(on_dev(mine), root_rank=root, name=f"bc.{root}.{tag}"),
                       values(root, n, dt))
            t = on_dev(mine)
            hvd.broadcast_(t, root_rank=N - 1, name=f"bc_.{tag}")
            expect(f"broadcast_ {tag}", t, values(N - 1, n, dt))

        @check(f"alltoall {tag}")
        def _():
            # rank r sends j + 1 rows of value 10 * r + j to rank j
            send = torch.cat([torch.full((j + 1, 2), float(10 * R + j), dtype=dt) for j in range(N)])
            splits = torch.tensor([j + 1 for j in range(N)], dtype=torch.int32)
            got = hvd.alltoall(on_dev(send), splits=splits, name=f"a2a.{tag}")
            if isinstance(got, tuple):        # (output, received_splits)
                got = got[0]
            want_ = torch.cat([torch.full((R + 1, 2), float(10 * r + R), dtype=dt) for r in range(N)])
            expect(f"alltoall {tag}", got, want_)

        @check(f"reducescatter {tag}")
        def _():
            full = mine[:2 * N * 4].reshape(2 * N, 4)           # every rank gets 2 rows
            every_full = torch.stack([values(r, n, dt)[:2 * N * 4].reshape(2 * N, 4).double()
                                      for r in range(N)])
            for op_name, op, red in (("Sum", hvd.Sum, every_full.sum(0)),
                                     ("Average", hvd.Average, every_full.mean(0))):
                expect(f"reducescatter {op_name} {tag}",
                       hvd.reducescatter(on_dev(full), op=op, name=f"rs.{op_name}.{tag}"),
                       red[2 * R:2 * R + 2].to(dt))


    if DEV.type == "cuda" and N == 1:
        @check("NCCL carried the CUDA tensors")
        def _():
            import torch.distributed as dist
            backend = dist.get_backend() if dist.is_initialized() else "no process group"
            if "nccl" not in str(backend):
                FAILS.append(f"torch.distributed backend is {backend!r}, not NCCL")


# ---------------------------------------------------------------- optimizer
STEPS, BATCH = 4, 16


def make_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10)).to(DEV)


def train(distributed, steps=STEPS):
    """SGD with momentum on fixed random batches; distributed: this rank's share of each."""
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(steps, BATCH, 3, 16, 16, generator=g)
    ys = torch.randint(0, 10, (steps, BATCH), generator=g)
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for s in range(steps):
        x, y = xs[s], ys[s]
        if distributed:
            x, y = x.chunk(N)[R], y.chunk(N)[R]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(DEV)), y.to(DEV)).backward()
        opt.step()
    return model


def optimizer():
    torch.backends.cudnn.deterministic = True     # the same sums on every run
    torch.backends.cudnn.benchmark = False

    @check(f"DistributedOptimizer CNN at {N} rank(s) matches one process")
    def _():
        model = train(distributed=True)
        ref = train(distributed=False)
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            if a.device != DEV:
                FAILS.append(f"parameter {name} moved to {a.device}")
            expect(f"parameter {name}", a.detach(), b.detach().cpu(), atol=1e-4)

    @check(f"broadcast_optimizer_state of Adam at {N} rank(s)")
    def _():
        # Adam's state mixes CUDA tensors (exp_avg, exp_avg_sq) with a CPU one (step):
        # rank 0 takes one step, the others none; afterwards every rank holds rank 0's state.
        def adam(step):
            model = make_cnn()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            if step:
                x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))
                model(x.to(DEV)).square().mean().backward()
                opt.step()
            return opt
        opt, ref = adam(R == 0), adam(True)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        got, want = opt.state_dict()["state"], ref.state_dict()["state"]
        if sorted(got) != sorted(want):
            FAILS.append(f"optimizer state of parameters {sorted(got)}, expected {sorted(want)}")
        for pid in want:
            for key, w in want[pid].items():
                g = got.get(pid, {}).get(key)
                if not isinstance(g, torch.Tensor) or g.device != w.device:
                    FAILS.append(f"state[{pid}][{key!r}]: {g!r:.60}, expected a tensor on {w.device}")
                elif not torch.allclose(g.cpu(), w.cpu(), atol=1e-6, rtol=0):
                    FAILS.append(f"state[{pid}][{key!r}]: values differ from rank 0's")


# ---------------------------------------------------------------- timeline
def timeline():
    @check("training steps with the timeline on")
    def _():
        train(distributed=True, steps=3)
        if ARGS.device == "cuda":
            torch.cuda.synchronize()


def first_collective_works():
    """One small allreduce first: where the CUDA path fails outright (at 2 ranks on one GPU,
    NCCL's refusal of a shared device), say so once instead of once per check."""
    try:
        hvd.allreduce(torch.ones(4, device=DEV), op=hvd.Sum, name="probe")
        return True
    except Exception as exc:  # noqa: BLE001 - reported
        FAILS.append(f"the first allreduce of a {DEV.type} tensor at {N} rank(s) raised "
                     f"{type(exc).__name__}: {exc}; the other checks were not run")
        return False


if first_collective_works():
    {"collectives": collectives, "optimizer": optimizer, "timeline": timeline}[ARGS.what]()
finish(hvd)
