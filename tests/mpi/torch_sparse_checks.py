"""hvd_magic.torch under real MPI: sparse gradients in DistributedOptimizer (kept sparse and
reduced outside the buckets, or densified with sparse_as_dense) and broadcast_optimizer_state
on an optimizer without state. Every rank computes the single-process reference itself.

Exits nonzero with one line per failed check, prefixed by the rank."""
import os

os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")   # a bug fails, never hangs

import torch  # noqa: E402

import hvd_magic.torch as hvd  # noqa: E402
from checklib import FAILS, check, close, finish  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
torch.set_num_threads(1)


class Net(torch.nn.Module):
    """A sparse embedding and a dense head: their float32 gradients share one bucket."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 3, sparse=True)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, idx, use_emb=True):
        x = self.emb(idx) if use_emb else torch.ones(len(idx), 3)
        return self.head(x).sum()


def inputs(step, rank):
    """Rank r's indices at a step; on step 2 rank 1 does not use the embedding at all."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 10, (2 + rank,), generator=g), not (step == 2 and rank == 1)


def reference(steps, lr):
    """Single process: SGD on the gradients averaged over the N ranks."""
    model = Net()
    for s in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(N):
            model.zero_grad(set_to_none=True)
            idx, use = inputs(s, r)
            model(idx, use).backward()
            for acc, p in zip(grads, model.parameters()):
                if p.grad is not None:
                    acc += p.grad.to_dense() / N
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= lr * g
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


for as_dense in (False, True):
    @check(f"sparse embedding + dense head, SGD, sparse_as_dense={as_dense}")
    def _():
        model = Net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=as_dense)
        for s in range(4):
            opt.zero_grad()
            idx, use = inputs(s, R)
            model(idx, use).backward()
            opt.step()
            if not model.emb.weight.grad.is_sparse:
                FAILS.append(f"sparse_as_dense={as_dense}: step {s}: the embedding's reduced "
                             "gradient is dense, not sparse")
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        close(f"sparse_as_dense={as_dense}: weights after 4 steps", got, reference(4, 0.5))

    @check(f"SparseAdam on a sparse embedding, sparse_as_dense={as_dense}")
    def _():
        torch.manual_seed(1)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        ref = torch.nn.Embedding(10, 3, sparse=True)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=as_dense)
        emb(inputs(0, R)[0]).sum().backward()
        opt.step()
        ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
        grad = sum(torch.autograd.grad(ref(inputs(0, r)[0]).sum(), ref.weight)[0].to_dense()
                   for r in range(N)) / N
        ref.weight.grad = grad.to_sparse(1)
        ref_opt.step()
        close(f"SparseAdam sparse_as_dense={as_dense}", emb.weight.detach(), ref.weight.detach())


@check("broadcast_optimizer_state before the first step")
def _():
    torch.manual_seed(R)            # ranks start different; parameters are broadcast first
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    w = torch.nn.Parameter(torch.randn(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([frozen, w], lr=0.1, momentum=0.9,
                                                   weight_decay=0.1, nesterov=True))
    hvd.broadcast_parameters([("frozen", frozen), ("w", w)], root_rank=0)
    before = w.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    close("parameters unchanged", w.detach(), before, 0.0)
    if frozen.grad is not None or w.grad is None or bool(w.grad.any()):
        FAILS.append(f"grads after broadcast_optimizer_state: frozen {frozen.grad}, w {w.grad}")
    if opt.state_dict()["state"]:
        FAILS.append(f"state after broadcast_optimizer_state: {opt.state_dict()['state']}")
    close("same grads on every rank", hvd.broadcast(w.grad, root_rank=0), w.grad, 0.0)


finish(hvd)
