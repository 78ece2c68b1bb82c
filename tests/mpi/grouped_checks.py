"""Grouped allgather / reducescatter (hvd_magic.collectives and hvd_magic.torch) and the torch
face's sparse_allreduce_async under real MPI: values against references every rank computes
itself, against the single ops, the torch gradients, mismatch errors naming the member
tensor on every rank, and local argument errors.

Exits nonzero with one line per failed check, prefixed by the rank."""
import os

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hvd_magic.collectives as C  # noqa: E402
import hvd_magic.torch as hvd  # noqa: E402
from checklib import FAILS, check, close, finish  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_num_threads(1)


def my_share(rows):
    """(start, count) of this rank's rows of a reducescatter over ``rows`` rows."""
    q, rem = divmod(rows, N)
    return R * q + min(R, rem), q + (1 if R < rem else 0)


def expect_mismatch(label, call, member):
    try:
        call()
        FAILS.append(f"{label}: no error")
    except hvd.TensorMismatchError as exc:
        if f"'{member}'" not in str(exc):
            FAILS.append(f"{label}: message does not name '{member}': {exc}")
    close(f"{label}: usable afterwards", C.allreduce(np.ones(2), name=f"after {label}"), [1.0, 1.0])


def expect_error(label, call, exc_type, text):
    try:
        call()
        FAILS.append(f"{label}: no {exc_type.__name__}")
    except exc_type as exc:
        if text not in str(exc):
            FAILS.append(f"{label}: message lacks {text!r}: {exc}")


# ---------------------------------------------------------------- hvd_magic.collectives
def gather_inputs(r):
    return [np.full((r + 1, 2), r, np.float32), np.arange(3, dtype=np.int64) + 10 * r,
            np.array(float(r)), torch.full((1, 3), float(r)), np.zeros((0, 2), np.int32)]


@check("collectives grouped_allgather")
def _():
    mine = gather_inputs(R)
    want = [np.concatenate(parts) if not isinstance(parts[0], torch.Tensor) else torch.cat(parts)
            for parts in zip(*[[p if p.ndim else p.reshape(1) for p in gather_inputs(r)]
                               for r in range(N)])]
    singles = [C.allgather(t) for t in mine]
    for label, got in [("sync", C.grouped_allgather(mine, name="ga.values")),
                       ("unnamed", C.grouped_allgather(mine)),
                       ("unnamed again", C.grouped_allgather(mine)),
                       ("async", C.synchronize(C.grouped_allgather_async(mine, name="ga.async")))]:
        if len(got) != len(mine):
            FAILS.append(f"grouped_allgather {label}: {len(got)} results for {len(mine)} tensors")
            continue
        for i, (g, w, s) in enumerate(zip(got, want, singles)):
            close(f"grouped_allgather {label} {i}", g, w, 0.0)
            close(f"grouped_allgather {label} {i} == allgather", g, s, 0.0)
            if type(g) is not type(mine[i]) or g.dtype != mine[i].dtype:
                FAILS.append(f"grouped_allgather {label} {i}: {type(g).__name__} {g.dtype}, "
                             f"input {type(mine[i]).__name__} {mine[i].dtype}")
    h = C.grouped_allgather_async([np.ones(1)], name="ga.poll")
    if not isinstance(C.poll(h), bool):
        FAILS.append("poll of a grouped_allgather handle is not a bool")
    close("grouped_allgather poll/synchronize", C.synchronize(h)[0], np.ones(N), 0.0)


@check("collectives grouped_reducescatter")
def _():
    rows = 2 * N + 1
    base = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2)
    start, count = my_share(rows)
    tri = N * (N + 1) / 2
    x = [base * (R + 1), (base * (R + 1)).astype(np.int32), torch.tensor(base[:N] * (R + 1))]
    for op, pre, post, factor in [(hvd.Sum, 1.0, 1.0, tri), (hvd.Average, 1.0, 1.0, tri / N),
                                  (hvd.Sum, 2.0, 0.5, tri), (hvd.Max, 1.0, 1.0, N)]:
        got = C.grouped_reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
        label = f"grouped_reducescatter {op.name} pre={pre} post={post}"
        if op == hvd.Average:     # integer Average rounds down: compare with the single op
            close(f"{label} int", got[1], C.reducescatter(x[1], op=op), 0.0)
        else:
            close(f"{label} int", got[1], (base * factor)[start:start + count], 0.0)
        close(f"{label} float", got[0], (base * factor)[start:start + count])
        close(f"{label} torch", got[2], (base[:N] * factor)[R:R + 1])   # N rows: one each
        if not isinstance(got[2], torch.Tensor) or got[1].dtype != np.int32:
            FAILS.append(f"{label}: result types {[type(g).__name__ for g in got]}")
        singles = [C.reducescatter(t, op=op, prescale_factor=pre, postscale_factor=post) for t in x]
        for i, (g, s) in enumerate(zip(got, singles)):
            close(f"{label} {i} == reducescatter", g, s, 0.0)
    h = C.grouped_reducescatter_async([np.ones((N, 1))], name="grs.async", op=hvd.Sum)
    close("grouped_reducescatter async", C.synchronize(h)[0], [[float(N)]], 0.0)


@check("collectives grouped errors")
def _():
    for fn in (C.grouped_allgather, C.grouped_reducescatter, hvd.grouped_allgather,
               hvd.grouped_reducescatter):
        expect_error(f"{fn.__module__}.{fn.__name__} empty", lambda: fn([]), ValueError, "empty")
        expect_error(f"{fn.__module__}.{fn.__name__} not a list", lambda: fn(np.ones(2)),
                     TypeError, "list")
    expect_error("grouped_reducescatter 0-d", lambda: C.grouped_reducescatter([np.ones(2), np.array(1.0)]),
                 ValueError, "tensor 1")
    expect_error("grouped_allgather a str", lambda: C.grouped_allgather([np.ones(2), "x"]), TypeError, "str")
    odd = N - 1
    expect_mismatch("grouped_allgather shape",
                    lambda: C.grouped_allgather([np.zeros((1, 2)), np.zeros((1, 2 + (R == odd)))],
                                                name="gm.ag"), "gm.ag.1")
    expect_mismatch("grouped_reducescatter shape",
                    lambda: C.grouped_reducescatter([np.zeros(N + (R == odd)), np.zeros(N)],
                                                    name="gm.rs"), "gm.rs.0")
    expect_mismatch("grouped_reducescatter dtype",
                    lambda: C.grouped_reducescatter([np.zeros(N), np.zeros(N, np.float32 if R == odd
                                                                           else np.float64)],
                                                    name="gm.dt"), "gm.dt.1")
    expect_mismatch("torch grouped_allgather shape",
                    lambda: hvd.grouped_allgather([torch.zeros(1, 2 + (R == odd))], name="gm.t"), "gm.t.0")


# ---------------------------------------------------------------- hvd_magic.torch
@check("torch grouped_allgather values and gradients")
def _():
    xs = [torch.full((R + 1, 2), float(R)).requires_grad_(), torch.tensor(float(R)).requires_grad_(),
          torch.arange(2, dtype=torch.float64).add(R).requires_grad_()]
    ys = hvd.grouped_allgather(xs, name="tg.ag")
    total = N * (N + 1) // 2
    close("torch grouped_allgather 0", ys[0], torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)]), 0)
    close("torch grouped_allgather 1", ys[1], torch.arange(N, dtype=torch.float32), 0)
    close("torch grouped_allgather 2", ys[2], torch.cat([torch.arange(2.0) + r for r in range(N)]), 0)
    if ys[2].dtype != torch.float64:
        FAILS.append(f"torch grouped_allgather dtype {ys[2].dtype}")
    w0 = torch.arange(total * 2, dtype=torch.float32).reshape(total, 2)
    w1 = torch.arange(N, dtype=torch.float32) + 1
    w2 = torch.arange(2 * N, dtype=torch.float64) + 3
    ((ys[0] * w0).sum() + (ys[1] * w1).sum() + (ys[2] * w2).sum()).backward()
    off = R * (R + 1) // 2      # the same loss on every rank: the averaged gradient is its own
    close("torch grouped_allgather grad 0", xs[0].grad, w0[off:off + R + 1])
    close("torch grouped_allgather grad 0-d", xs[1].grad, w1[R])
    close("torch grouped_allgather grad 2", xs[2].grad, w2[2 * R:2 * R + 2])
    # the same as the single allgather's gradient
    x = torch.full((R + 1, 2), float(R)).requires_grad_()
    (hvd.allgather(x) * w0).sum().backward()
    close("torch grouped_allgather grad == allgather grad", xs[0].grad, x.grad)
    h = hvd.grouped_allgather_async([torch.ones(1)], name="tg.async")
    close("torch grouped_allgather_async", hvd.synchronize(h)[0], torch.ones(N), 0)


@check("torch grouped_reducescatter values and gradients")
def _():
    rows = 2 * N + 1
    start, count = my_share(rows)
    base = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    w = torch.linspace(-1.0, 2.0, rows * 3).reshape(rows, 3)
    # gradients follow Horovod's rule: allgathered, times the scale factors, times N for Sum
    for op, pre, post, value, grad in [(hvd.Sum, 1.0, 1.0, N * (N + 1) / 2, float(N)),
                                       (hvd.Sum, 2.0, 0.5, N * (N + 1) / 2, float(N)),
                                       (hvd.Average, 1.0, 3.0, 3.0 * (N + 1) / 2, 1.0)]:
        xs = [(base * (R + 1)).requires_grad_(), (base[:N] * (R + 1)).double().requires_grad_()]
        ys = hvd.grouped_reducescatter(xs, name=f"tg.rs.{op.name}.{pre}", op=op, prescale_factor=pre,
                                       postscale_factor=post)
        label = f"torch grouped_reducescatter {op.name} pre={pre} post={post}"
        close(f"{label} 0", ys[0], (base * value)[start:start + count], 1e-4)
        close(f"{label} 1", ys[1], (base[:N] * value)[R:R + 1], 1e-4)
        ((ys[0] * w[start:start + count]).sum() + ys[1].sum()).backward()
        # the weights of the rows, times the scale
        close(f"{label} grad 0", xs[0].grad, w * grad * pre * post)
        close(f"{label} grad 1", xs[1].grad, torch.full((N, 3), grad * pre * post, dtype=torch.float64))
    out = hvd.grouped_reducescatter([torch.ones(N, 2)], compression=hvd.Compression.fp16, op=hvd.Sum)[0]
    close("torch grouped_reducescatter fp16", out, torch.full((1, 2), float(N)), 0)
    if out.dtype != torch.float32:
        FAILS.append(f"torch grouped_reducescatter fp16: dtype {out.dtype}")
    x = torch.ones(N, 2).requires_grad_()
    y = hvd.grouped_reducescatter([x], op=hvd.Max)[0]
    expect_error("torch grouped_reducescatter Max backward", lambda: y.sum().backward(), ValueError, "Average")
    h = hvd.grouped_reducescatter_async([torch.ones(N, 1)], op=hvd.Sum)
    close("torch grouped_reducescatter_async", hvd.synchronize(h)[0], torch.full((1, 1), float(N)), 0)


# ---------------------------------------------------------------- sparse allreduce
def sparse_of(r):
    """Rows r % 6 and (r + 2) % 6 of a 6x2 tensor, holding r + 1 and 10 * (r + 1)
    (ranks 0 and 2 share row 2 at 3 ranks)."""
    idx = torch.tensor([[r % 6, (r + 2) % 6]])
    vals = torch.tensor([[r + 1.0, r + 1.0], [10.0 * (r + 1), 0.5]])
    return torch.sparse_coo_tensor(idx, vals, (6, 2), check_invariants=False)


@check("torch sparse_allreduce_async")
def _():
    total = sum(sparse_of(r).to_dense() for r in range(N))
    for op, want in [(hvd.Sum, total), (hvd.Average, total / N)]:
        h = hvd.sparse_allreduce_async(sparse_of(R), f"sp.{op.name}", op)
        if not isinstance(hvd.poll(h), bool):
            FAILS.append("poll of a sparse handle is not a bool")
        out = hvd.synchronize(h)
        if not out.is_sparse or out._nnz() != 2 * N or out.is_coalesced():
            FAILS.append(f"sparse {op.name}: want an uncoalesced sparse tensor with {2 * N} entries, "
                         f"got sparse={out.is_sparse} nnz={out._nnz()}")
        close(f"sparse {op.name}", out.to_dense(), want)
        close(f"sparse {op.name} handle()", h().to_dense(), want)
    # an embedding's gradient, unnamed (as DistributedOptimizer users call it)
    emb = torch.nn.Embedding(5, 3, sparse=True)
    with torch.no_grad():
        emb.weight.fill_(1.0)
    emb(torch.tensor([R % 5, R % 5])).sum().backward()
    out = hvd.sparse_allreduce_async(emb.weight.grad, None, hvd.Average)()
    want = torch.zeros(5, 3)
    for r in range(N):
        want[r % 5] += 2.0 / N
    close("sparse embedding grad average", out.to_dense(), want)
    ints = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([R + 1]), (2,), check_invariants=False)
    close("sparse int average", hvd.synchronize(hvd.sparse_allreduce_async(ints, "sp.int", hvd.Average)).to_dense(),
          [(N + 1) / 2, 0.0])
    expect_error("sparse of a dense tensor", lambda: hvd.sparse_allreduce_async(torch.ones(2), "sp.x", hvd.Sum),
                 TypeError, "sparse")
    expect_error("sparse Max", lambda: hvd.sparse_allreduce_async(sparse_of(R), "sp.y", hvd.Max),
                 ValueError, "Average")



@check("torch grouped_allreduce values, outputs, gradients, in place")
def _():
    tri = N * (N + 1) / 2
    shapes = [(3,), (2, 4), (), (5,)]
    xs = [torch.arange(float(torch.Size(sh).numel())).reshape(sh) * (R + 1) for sh in shapes]
    wants = [torch.arange(float(torch.Size(sh).numel())).reshape(sh) * tri for sh in shapes]
    outs = hvd.grouped_allreduce(xs, name="tga.sum", op=hvd.Sum)
    for i, (o, w) in enumerate(zip(outs, wants)):
        close(f"torch grouped_allreduce {i}", o, w)
        if not isinstance(o, torch.Tensor) or o.shape != w.shape or o.requires_grad:
            FAILS.append(f"torch grouped_allreduce {i}: {type(o).__name__} {tuple(o.shape)}")
    # each output is a tensor of its own: changing one in place leaves the others
    outs[0].mul_(0)
    close("torch grouped_allreduce outputs apart", outs[1], wants[1])
    # gradients of the average: the average of the upstream gradients (Horovod's rule)
    ps = [x.clone().requires_grad_() for x in xs]
    ys = hvd.grouped_allreduce(ps, name="tga.grad")
    if not all(y.requires_grad for y in ys):
        FAILS.append("torch grouped_allreduce of tensors that require grad: outputs do not")
    sum((y * (R + 1)).sum() for y in ys).backward()
    for i, (pp, sh) in enumerate(zip(ps, shapes)):
        close(f"torch grouped_allreduce grad {i}", pp.grad, torch.full(sh, tri / N))
    # fp16 compression, bfloat16, in place (a transposed member included)
    half = hvd.grouped_allreduce(xs, name="tga.fp16", op=hvd.Sum,
                                 compression=hvd.Compression.fp16)
    for i, (o, w) in enumerate(zip(half, wants)):
        close(f"torch grouped_allreduce fp16 {i}", o, w, 1e-2)
    bf = hvd.grouped_allreduce([x.to(torch.bfloat16) for x in xs], name="tga.bf16", op=hvd.Sum)
    for i, (o, w) in enumerate(zip(bf, wants)):
        if o.dtype != torch.bfloat16:
            FAILS.append(f"torch grouped_allreduce bfloat16 {i}: {o.dtype}")
        close(f"torch grouped_allreduce bfloat16 {i}", o.float(), w, 0.5)
    ins = [x.clone() for x in xs] + [torch.full((3, 2), float(R)).t()]
    ret = hvd.grouped_allreduce_(ins, name="tga.inplace", op=hvd.Sum)
    for i, (t, w) in enumerate(zip(ins, wants + [torch.full((2, 3), tri - N)])):
        if ret[i] is not t:
            FAILS.append(f"torch grouped_allreduce_ {i}: result is not the input")
        close(f"torch grouped_allreduce_ {i}", t, w)


finish(hvd)
