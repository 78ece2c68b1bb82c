"""hvd_magic.torch under real MPI: DistributedOptimizer equivalence with single-process
training, broadcasts of parameters and optimizer state, error paths, SyncBatchNorm and
autograd of the collectives. Every rank computes single-process references itself.

Exits nonzero with one line per failed check, prefixed by the rank."""
import hashlib
import os
import sys
import traceback

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import torch  # noqa: E402

import hvd_magic.torch as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
FAILS = []
torch.set_num_threads(1)


import time  # noqa: E402
TIMES = os.environ.get("TORCH_CHECKS_TIMES") == "1"


def check(label):
    def deco(fn):
        t0 = time.perf_counter()
        try:
            fn()
            if TIMES and R == 0:
                print(f"{label}: {time.perf_counter() - t0:.2f} s", flush=True)
        except Exception:
            FAILS.append(f"{label}: raised\n{traceback.format_exc()}")
        return fn
    return deco


def close(label, a, b, atol):
    if not torch.allclose(a, b, atol=atol, rtol=0):
        FAILS.append(f"{label}: max diff {(a - b).abs().max().item():.3g} > {atol}")


# ---------------------------------------------------------------- training equivalence
STEPS, BATCH = 5, 12
g = torch.Generator().manual_seed(123)
XS = torch.randn(STEPS, BATCH, 4, generator=g)
YS = torch.randn(STEPS, BATCH, 1, generator=g)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def train(make_opt, distributed, bpps=1, compression=hvd.Compression.none, clip=None,
          keep_grads=False, **kw):
    model = make_model()
    opt = make_opt(model.parameters())
    if kw.get("groups") == "lists":
        kw["groups"] = [[model[0].weight, model[2].weight], [model[0].bias, model[2].bias]]
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       backward_passes_per_step=bpps, compression=compression, **kw)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for s in range(STEPS):
        x, y = XS[s], YS[s]
        if distributed:
            x, y = x.chunk(N)[R], y.chunk(N)[R]
        opt.zero_grad(set_to_none=not keep_grads)
        for xm, ym in zip(x.chunk(bpps), y.chunk(bpps)):
            (torch.nn.functional.mse_loss(model(xm), ym) / bpps).backward()
        if clip is None:
            opt.step()
        elif distributed:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def make_model_flat():
    return torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])


CASES = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, 1e-5),
    "momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, 1e-5),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=0.01), {}, 1e-4),
    "bpps2": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"bpps": 2}, 1e-5),
    "fp16": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"compression": hvd.Compression.fp16}, 2e-3),
    "bf16": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"compression": hvd.Compression.bf16}, 2e-2),
    "clip": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"clip": 0.05}, 1e-5),
    "groups_lists": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"groups": "lists"}, 1e-5),
    "groups2": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"groups": 2}, 1e-5),
    "predivide": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"gradient_predivide_factor": 2.0}, 1e-5),
    "keep_grads": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"keep_grads": True}, 1e-5),
    "keep_grads_bpps2": (lambda ps: torch.optim.Adam(ps, lr=0.01), {"keep_grads": True, "bpps": 2}, 1e-4),
}

# Gradient bucketing settings (HVD_MAGIC_BUCKET_BYTES, HVD_MAGIC_GRAD_VIEWS; read when the
# optimizer is wrapped). The test model's 4 tensors are 128, 32, 32 and 4 bytes: by default
# one bucket; "30" gives [bias2, weight2] + two single-parameter buckets; "0" no buckets.
BUCKET_VARIANTS = {"": {}, "bytes=0": {"HVD_MAGIC_BUCKET_BYTES": "0"},
                   "bytes=30": {"HVD_MAGIC_BUCKET_BYTES": "30"},
                   "bytes=30,views=0": {"HVD_MAGIC_BUCKET_BYTES": "30", "HVD_MAGIC_GRAD_VIEWS": "0"},
                   "bytes=1,1000": {"HVD_MAGIC_BUCKET_BYTES": "1,1000"}}
BUCKET_KEYS = ("HVD_MAGIC_BUCKET_BYTES", "HVD_MAGIC_GRAD_VIEWS")


def set_bucket_env(env):
    for k in BUCKET_KEYS:
        os.environ.pop(k, None)
    os.environ.update(env)


for vname, venv in BUCKET_VARIANTS.items():
    vlabel = f" [{vname}]" if vname else ""
    for cname, (mk, kw, tol) in CASES.items():
        if vname and cname in ("adam", "clip", "predivide"):
            continue
        @check(f"equivalence {cname}{vlabel}")
        def _():
            set_bucket_env(venv)
            bpps = kw.get("bpps", 1)
            extra = {k: v for k, v in kw.items() if k != "bpps"}
            ref = train(mk, False, bpps=bpps, clip=extra.get("clip"))
            got = train(mk, True, bpps=bpps, **extra)
            close(f"equivalence {cname}{vlabel}", got, ref, tol)
            if torch.allclose(got, make_model_flat(), atol=1e-4):
                FAILS.append(f"equivalence {cname}{vlabel}: parameters did not move")

    @check(f"sum op{vlabel}")
    def _():
        set_bucket_env(venv)
        ref = train(lambda ps: torch.optim.SGD(ps, lr=0.1), False)
        got = train(lambda ps: torch.optim.SGD(ps, lr=0.1 / N), True, op=hvd.Sum)
        # Sum of per-shard mean losses = N * full-batch mean loss gradient: lr/N compensates
        close(f"sum op{vlabel}", got, ref, 1e-5)
set_bucket_env({})


# ---------------------------------------------------------------- bucketing: requests per step
def make_deep(width=32, depth=6):
    torch.manual_seed(1)
    layers = [torch.nn.Linear(4, width), torch.nn.Tanh()]
    for _ in range(depth - 2):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def count_requests(env, bpps=1, steps=3, keep_grads=False, compression=hvd.Compression.none):
    """Train make_deep() distributed; return (optimizer, names submitted per step, flat params)."""
    import hvd_magic.collectives as HC
    set_bucket_env(env)
    model = make_deep()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=bpps, compression=compression)
    set_bucket_env({})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    seen = []
    orig = HC.allreduce_async_

    def spy(tensor, name=None, **kw):
        seen[-1].append(name)
        return orig(tensor, name=name, **kw)
    HC.allreduce_async_ = spy
    try:
        for s in range(steps):
            seen.append([])
            opt.zero_grad(set_to_none=not keep_grads)
            for xm, ym in zip(XS[s].chunk(N)[R].chunk(bpps), YS[s].chunk(N)[R].chunk(bpps)):
                (torch.nn.functional.mse_loss(model(xm), ym) / bpps).backward()
            opt.step()
    finally:
        HC.allreduce_async_ = orig
    return opt, model, seen


def train_deep_ref(bpps=1, steps=3):
    model = make_deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        opt.zero_grad()
        for xm, ym in zip(XS[s].chunk(bpps), YS[s].chunk(bpps)):
            (torch.nn.functional.mse_loss(model(xm), ym) / bpps).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# make_deep(): 12 tensors; weights 4x32 (512 B), 32x32 (4096 B) x4, 32x1 (128 B); biases 128 B, 4 B
for label, env, kw in (("default", {}, {}), ("8 KiB", {"HVD_MAGIC_BUCKET_BYTES": "8192"}, {}),
                       ("8 KiB bpps=2", {"HVD_MAGIC_BUCKET_BYTES": "8192"}, {"bpps": 2}),
                       ("8 KiB keep grads", {"HVD_MAGIC_BUCKET_BYTES": "8192"}, {"keep_grads": True}),
                       ("8 KiB fp16", {"HVD_MAGIC_BUCKET_BYTES": "8192"},
                        {"compression": hvd.Compression.fp16}),
                       ("off", {"HVD_MAGIC_BUCKET_BYTES": "0"}, {})):
    @check(f"bucketing requests per step {label}")
    def _():
        opt, model, seen = count_requests(env, **kw)
        n_buckets = len(opt._hvd_buckets)
        n_params = len(list(model.parameters()))
        want = {"default": 1, "8 KiB": 3, "off": n_params}.get(label, 3)
        if n_buckets != want:
            FAILS.append(f"bucketing {label}: {n_buckets} buckets, expected {want}: {opt._hvd_buckets}")
        for s, names in enumerate(seen):
            if len(names) != n_buckets:
                FAILS.append(f"bucketing {label}: step {s} made {len(names)} requests, expected {n_buckets}")
            if sorted(names) != sorted(seen[0]):
                FAILS.append(f"bucketing {label}: names changed between steps: {seen[0]} vs {names}")
        if label == "off":
            if sorted(seen[0]) != sorted(n for n, _ in model.named_parameters()):
                FAILS.append(f"bucketing off: names {seen[0]}")
        else:
            multi = [b.name for b in opt._hvd_buckets if len(b.params) > 1]
            if not multi or not all(n.startswith("grad.bucket") and "[" in n for n in multi):
                FAILS.append(f"bucketing {label}: bucket names {seen[0]}")
        allnames = hvd.allgather_object(sorted(seen[0]))
        if any(a != allnames[0] for a in allnames):
            FAILS.append(f"bucketing {label}: names differ between ranks {allnames}")
        tol = 2e-3 if "fp16" in label else 1e-5
        close(f"bucketing {label} equivalence", flat_params(model), train_deep_ref(kw.get("bpps", 1)), tol)
        # p.grad holds the averaged gradient after step (a view into the bucket by default)
        if label == "keep grads":
            for b in opt._hvd_buckets:
                if b.flat is not None:
                    for p in b.params:
                        if p.grad.data_ptr() != b.views[p].data_ptr():
                            FAILS.append(f"bucketing {label}: grad of a bucket member is not its view")


@check("bucketing: grads are the average after synchronize")
def _():
    set_bucket_env({"HVD_MAGIC_BUCKET_BYTES": "8192"})
    for keep in (False, True):
        model = make_deep()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters())
        for s in range(2):
            # The local gradients come from an unhooked twin: reading p.grad after backward
            # would race with the bucket's in-place allreduce, which may already have run.
            twin = make_deep()
            twin.load_state_dict(model.state_dict())
            torch.nn.functional.mse_loss(twin(XS[s].chunk(N)[R]), YS[s].chunk(N)[R]).backward()
            local = [p.grad.clone() for p in twin.parameters()]
            opt.zero_grad(set_to_none=not keep)
            torch.nn.functional.mse_loss(model(XS[s].chunk(N)[R]), YS[s].chunk(N)[R]).backward()
            opt.synchronize()
            for (n, p), g in zip(model.named_parameters(), local):
                want = hvd.allreduce(g, name=f"check.avg.{n}")
                close(f"bucketing average {n} keep={keep} step {s}", p.grad, want, 1e-6)
            with opt.skip_synchronize():
                opt.step()
    set_bucket_env({})


# ---------------------------------------------------------------- broadcasts
def canon(model, opt):
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.detach().numpy().tobytes())
    sd = opt.state_dict()
    h.update(repr([{k: v for k, v in grp.items()} for grp in sd["param_groups"]]).encode())
    for pid in sorted(sd["state"]):
        for k, v in sorted(sd["state"][pid].items()):
            h.update(f"{pid}.{k}".encode())
            h.update(v.detach().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()


for oname, mk in {"adam": lambda ps, r: torch.optim.Adam(ps, lr=0.01 * (r + 1), betas=(0.9, 0.99 - r / 100)),
                  "momentum": lambda ps, r: torch.optim.SGD(ps, lr=0.1 * (r + 1), momentum=0.5 + r / 10)}.items():
    for root_has_state in (True, False):
        @check(f"broadcast {oname} root_has_state={root_has_state}")
        def _():
            torch.manual_seed(100 + R)          # different weights and state on every rank
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
            opt = mk(model.parameters(), R)
            steps = (R + 1) if root_has_state else R      # root 0 has no state when False
            for _ in range(steps):
                opt.zero_grad()
                model(torch.randn(6, 4)).pow(2).sum().backward()
                opt.step()
            dist = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            before = [p.detach().clone() for p in model.parameters()]
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(dist, root_rank=0)
            if R == 0:
                for a, b in zip(before, model.parameters()):
                    close("root params unchanged", b.detach(), a, 0.0)
            hashes = hvd.allgather_object(canon(model, dist))
            if len(set(hashes)) != 1:
                FAILS.append(f"broadcast {oname} root_has_state={root_has_state}: hashes differ {hashes}")
            # training goes on in step on every rank
            dist.zero_grad()
            model(torch.randn(6, 4, generator=torch.Generator().manual_seed(5))).pow(2).sum().backward()
            dist.step()
            hashes = hvd.allgather_object(canon(model, dist))
            if len(set(hashes)) != 1:
                FAILS.append(f"broadcast {oname} root_has_state={root_has_state}: differ after a step")


@check("blocking allreduce_ on the same, a changed and a new tensor")
def _():
    r, n = hvd.rank(), hvd.size()
    t = torch.zeros(8)
    for step in range(6):          # the same tensor: from the second call on, reused as is
        t.fill_(float(r + step))
        hvd.allreduce_(t, name="same", op=hvd.Sum)
        close(f"same tensor step {step}", t, torch.full((8,), float(n * (n - 1) / 2 + n * step)), 1e-6)
    t.set_(torch.full((8,), float(r)))    # the same tensor object, other memory
    hvd.allreduce_(t, name="same", op=hvd.Sum)
    close("same tensor, other memory", t, torch.full((8,), float(n * (n - 1) / 2)), 1e-6)
    for step in range(3):          # a new tensor each step (gradients set to None)
        u = torch.full((8,), float(r + 1))
        hvd.allreduce_(u, name="same")
        close(f"new tensor step {step}", u, torch.full((8,), (n + 1) / 2), 1e-6)


@check("broadcast_parameters named list and root 1")
def _():
    torch.manual_seed(R)
    m = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(list(m.named_parameters()), root_rank=N - 1)
    got = hvd.allgather(m.weight.detach().reshape(1, -1))
    if not all(torch.equal(got[0], got[i]) for i in range(N)):
        FAILS.append("broadcast_parameters(named_parameters list): ranks differ")


# ---------------------------------------------------------------- error paths
@check("duplicate names")
def _():
    m = torch.nn.Linear(2, 2)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=[("w", m.weight), ("w", m.bias)])
        FAILS.append("duplicate names: no error")
    except ValueError as e:
        if "unique" not in str(e):
            FAILS.append(f"duplicate names: unclear message {e}")
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=[("w", m.weight)])
        FAILS.append("missing names: no error")
    except ValueError:
        pass
    for bad in (hvd.Max,):      # (Adasum works: tests/mpi/coll_adasum.py)
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), op=bad)
            FAILS.append(f"op={bad}: no error")
        except ValueError:
            pass


@check("too many backward passes")
def _():
    m = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), backward_passes_per_step=2)
    x = XS[0].chunk(N)[R]
    for _ in range(2):
        m(x).sum().backward()
    try:
        m(x).sum().backward()
        FAILS.append("too many backward passes: no error")
    except (RuntimeError, ValueError) as e:
        if "backward_passes_per_step" not in str(e):
            FAILS.append(f"too many backward passes: unclear message {e}")
    opt.synchronize()           # drains what is in flight; usable again
    opt.zero_grad()
    m(x).sum().backward()
    m(x).sum().backward()
    with opt.skip_synchronize():
        opt.synchronize()
        opt.step()


@check("rewrap and zero_grad guard")
def _():
    ref = train(lambda ps: torch.optim.SGD(ps, lr=0.1), False)
    model = make_model()
    stale = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),   # noqa: F841
                                     named_parameters=model.named_parameters())
    # a notebook cell run again: the newer wrapper takes over the gradients
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for s in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(XS[s].chunk(N)[R]), YS[s].chunk(N)[R]).backward()
        if s == 0:
            try:
                opt.zero_grad()
                FAILS.append("zero_grad between backward and step: no error")
            except RuntimeError:
                pass
        opt.step()
    close("rewrap", torch.cat([p.detach().reshape(-1) for p in model.parameters()]), ref, 1e-5)


@check("join with uneven data")
def _():
    def run(distributed, steps, last_scale=1.0):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        for s in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(XS[s]), YS[s]).backward()   # same data everywhere
            if s == steps - 1 and last_scale != 1.0:
                for p in model.parameters():
                    p.grad.mul_(last_scale)
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = run(True, 3 if R == 0 else 2)      # rank 0 has one more batch than the others
    last = hvd.join()
    if last != 0:
        FAILS.append(f"join returned {last}, expected 0 (rank 0 joined last)")
    if R == 0:    # its last step averages with the joined ranks' zeros (as Horovod): gradient / N
        close("join uneven", got, run(False, 3, 1.0 / N), 1e-5)


for vname, venv in BUCKET_VARIANTS.items():
    @check(f"unused parameter [{vname}]")
    def _():
        set_bucket_env(venv)
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 2)
        extra = torch.nn.Parameter(torch.zeros(4))
        params = [("lin.weight", lin.weight), ("lin.bias", lin.bias), ("extra", extra)]
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0),
                                       named_parameters=params)
        for step in range(2):
            opt.zero_grad()
            x = torch.full((2, 3), float(R + 1))
            loss = lin(x).sum() + (extra.sum() if R == 0 else 0.0)
            loss.backward()
            opt.step()
        # extra's averaged grad is 1/N each step (only rank 0 contributes ones)
        close("unused parameter value", extra.detach(), torch.full((4,), -2.0 / N), 1e-6)
        # lin.bias grad: every rank 2 per output -> average 2
        torch.manual_seed(0)
        ref = torch.nn.Linear(3, 2)
        close("unused parameter bias", lin.bias.detach(), ref.bias.detach() - 2 * 2.0, 1e-5)
    set_bucket_env({})


@check("shape mismatch")
def _():
    try:
        hvd.allreduce(torch.ones(2 if R == 0 else 3), name="mismatch.t")
        FAILS.append("shape mismatch: no error")
    except hvd.TensorMismatchError:
        pass
    m = torch.nn.Linear(3, 2 if R == 0 else 3)     # a model built differently on one rank
    try:   # found when the optimizer is built, on every rank, before any gradient can stall
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=m.named_parameters())
        FAILS.append("optimizer shape mismatch: no error")
    except hvd.TensorMismatchError as exc:
        if "models differ" not in str(exc) or "rank 1" not in str(exc):
            FAILS.append(f"optimizer shape mismatch: unclear message: {exc}")
    hvd.barrier()


# ---------------------------------------------------------------- SyncBatchNorm
for shape, affine, momentum in (((13, 3), True, 0.1), ((13, 3, 5), True, None),
                                ((7, 3, 2, 2), False, 0.3)):
    @check(f"SyncBatchNorm {shape} affine={affine} momentum={momentum}")
    def _():
        gen = torch.Generator().manual_seed(7)
        X = torch.randn(*shape, generator=gen) * 2 + 1
        G = torch.randn(*shape, generator=gen)
        bn = (torch.nn.BatchNorm1d if len(shape) < 4 else torch.nn.BatchNorm2d)(
            3, affine=affine, momentum=momentum)
        if affine:
            with torch.no_grad():
                bn.weight.copy_(torch.randn(3, generator=gen))
                bn.bias.copy_(torch.randn(3, generator=gen))
        sbn = hvd.SyncBatchNorm(3, affine=affine, momentum=momentum)
        sbn.load_state_dict(bn.state_dict())
        xr = X.clone().requires_grad_()
        y_ref = bn(xr)
        (y_ref * G).sum().backward()
        rows = torch.arange(shape[0]).tensor_split(N)[R]
        xs = X[rows].clone().requires_grad_()
        y = sbn(xs)
        close("SyncBatchNorm forward", y.detach(), y_ref.detach()[rows], 1e-5)
        (y * G[rows]).sum().backward()
        close("SyncBatchNorm grad x", xs.grad, xr.grad[rows], 1e-5)
        if affine:
            close("SyncBatchNorm grad weight", hvd.allreduce(sbn.weight.grad, op=hvd.Sum), bn.weight.grad, 1e-4)
            close("SyncBatchNorm grad bias", hvd.allreduce(sbn.bias.grad, op=hvd.Sum), bn.bias.grad, 1e-4)
        close("SyncBatchNorm running_mean", sbn.running_mean, bn.running_mean, 1e-6)
        close("SyncBatchNorm running_var", sbn.running_var, bn.running_var, 1e-5)
        bn.eval()
        sbn.eval()
        close("SyncBatchNorm eval", sbn(X[rows]), bn(X)[rows], 1e-6)


# ---------------------------------------------------------------- autograd of collectives
@check("autograd allreduce")
def _():
    w = torch.arange(3.0) + 1
    for op, want in ((hvd.Average, w), (hvd.Sum, w * N)):
        x = torch.randn(3).requires_grad_()
        (hvd.allreduce(x, op=op) * w).sum().backward()
        close(f"autograd allreduce {op.name}", x.grad, want, 1e-6)
    xs = [torch.randn(2).requires_grad_(), torch.randn(3).requires_grad_()]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    (outs[0].sum() + 2 * outs[1].sum()).backward()
    close("autograd grouped", xs[1].grad, torch.full((3,), 2.0 * N), 1e-6)


@check("autograd allgather")
def _():
    x = torch.full((R + 1, 2), float(R)).requires_grad_()
    y = hvd.allgather(x)
    total = N * (N + 1) // 2
    if y.shape != (total, 2):
        FAILS.append(f"allgather shape {tuple(y.shape)}")
    W = torch.arange(total * 2, dtype=torch.float32).reshape(total, 2)
    (y * W).sum().backward()
    off = R * (R + 1) // 2
    close("autograd allgather", x.grad, W[off:off + R + 1], 1e-6)   # averaged, as horovod.torch


@check("autograd alltoall")
def _():
    # equal splits: rank r sends row j to rank j; the gradient comes back to where rows came from
    x = (torch.arange(N, dtype=torch.float32) + 10 * R).requires_grad_()
    y = hvd.alltoall(x)
    close("alltoall value", y.detach(), torch.tensor([10.0 * k + R for k in range(N)]), 0.0)
    (y * (torch.arange(N, dtype=torch.float32) + 1)).sum().backward()
    close("autograd alltoall", x.grad, torch.full((N,), float(R + 1)), 0.0)
    # uneven splits: rank r sends r + 1 rows to rank 0, nothing to the others
    x = torch.full((R + 1, 2), float(R)).requires_grad_()
    out, received = hvd.alltoall(x, splits=[R + 1] + [0] * (N - 1))
    if received.tolist() != ([k + 1 for k in range(N)] if R == 0 else [0] * N):
        FAILS.append(f"alltoall received splits {received.tolist()}")
    (out * 3).sum().backward()
    close("autograd alltoall uneven", x.grad, torch.full((R + 1, 2), 3.0), 0.0)


@check("autograd reducescatter")
def _():
    for op, scale in ((hvd.Sum, N), (hvd.Average, 1)):    # Horovod's rule: Sum scales by N
        x = torch.ones(2 * N, 3).requires_grad_()
        y = hvd.reducescatter(x, op=op, prescale_factor=2.0)
        (y * (R + 1)).sum().backward()
        want = torch.cat([torch.full((2, 3), 2.0 * scale * (k + 1)) for k in range(N)])
        close(f"autograd reducescatter {op.name}", x.grad, want, 1e-6)


@check("autograd broadcast")
def _():
    root = N - 1
    x = torch.full((2,), float(R)).requires_grad_()
    y = hvd.broadcast(x, root_rank=root)
    close("broadcast value", y.detach(), torch.full((2,), float(root)), 0.0)
    (y * torch.tensor([1.0, 2.0])).sum().backward()
    want = torch.tensor([1.0, 2.0]) if R == root else torch.zeros(2)   # averaged, as horovod.torch
    close("autograd broadcast", x.grad, want, 1e-6)


@check("compression round trip")
def _():
    t = torch.randn(5, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    if c.dtype != torch.float16 or hvd.Compression.fp16.decompress(c, ctx).dtype != torch.float64:
        FAILS.append("fp16 compression dtypes")
    c, ctx = hvd.Compression.none.compress(t)
    if c is not t:
        FAILS.append("none compression copies")
    out = hvd.allreduce(torch.ones(4), compression=hvd.Compression.fp16, op=hvd.Sum)
    close("allreduce fp16", out, torch.full((4,), float(N)), 0.0)


hvd.barrier()
for f in FAILS:
    print(f"[rank {R}] FAIL {f}", flush=True)
print(f"[rank {R}] done, {len(FAILS)} failures", flush=True)
hvd.shutdown()
sys.exit(1 if FAILS else 0)
