"""Gradient buckets for ``DistributedOptimizer``: a few flat allreduces per step instead
of one per parameter.

At wrap time the parameters that require gradients are partitioned, per (device, dtype)
and in reverse registration order (backward produces gradients roughly last layer
first), into buckets of about ``HVD_MAGIC_BUCKET_BYTES`` bytes. A bucket of several
parameters owns a flat buffer; each parameter's gradient is copied into its slice when
autograd has accumulated it (or is already there: after the first step ``p.grad`` is a
view into the buffer, so ``zero_grad(set_to_none=False)`` + backward accumulate in
place), and once every parameter of the bucket is ready the whole buffer goes to the
runtime as ONE in-place ``allreduce_async_``. A bucket of one parameter reduces
``p.grad`` itself (no buffer, no copy), as without bucketing.

``HVD_MAGIC_BUCKET_BYTES``:

- ``0``: no bucketing, one request per parameter (named after the parameter);
- ``N``: buckets of about N bytes (a bucket is closed once it holds >= N bytes);
- ``A,B``: the first bucket (the last layers, whose gradients come first) of about A
  bytes, the others of about B: the first allreduce starts early in backward.
  Default ``1048576,4194304`` (1 MiB, then 4 MiB).

``HVD_MAGIC_GRAD_VIEWS=0`` keeps every ``p.grad`` the tensor autograd made (results are
copied back from the buffers after the allreduces) instead of making it a view into its
bucket's buffer.

Bucket names (in errors, stall reports and the timeline) read
``grad.bucket<i>[<first name>..<last name>]`` (registration order); they are the same on
every rank whose model has the same parameters.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch

import hvd_magic.collectives as C



def bucket_caps(env: Optional[str] = None) -> tuple:
    """(first bucket bytes, other buckets bytes) from ``HVD_MAGIC_BUCKET_BYTES``; (0, 0) = off."""
    from .. import config
    raw = config.get("HVD_MAGIC_BUCKET_BYTES", None if env is None else
                     {"HVD_MAGIC_BUCKET_BYTES": env}).strip()
    try:
        parts = [int(float(x)) for x in raw.split(",")]
    except ValueError:
        raise ValueError(f"HVD_MAGIC_BUCKET_BYTES must be a byte count or 'FIRST,REST' byte counts, "
                         f"got {raw!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or min(parts) < 0:
        raise ValueError(f"HVD_MAGIC_BUCKET_BYTES must be one or two byte counts >= 0, got {raw!r}")
    if 0 in parts:
        return (0, 0)
    return (parts[0], parts[1])


def grad_views_enabled() -> bool:
    from .. import config
    return config.get("HVD_MAGIC_GRAD_VIEWS")


class Bucket:
    """Parameters whose gradients are reduced together as one request."""

    __slots__ = ("index", "params", "name", "flat", "views", "pending", "submitted",
                 "handle", "compressed", "ctx")

    def __init__(self, index: int, params: Sequence[torch.Tensor], name: str):
        self.index = index
        self.params = tuple(params)
        self.name = name
        self.flat: Optional[torch.Tensor] = None     # None: a single parameter, reduced in p.grad
        self.views: dict = {}                        # param -> view of flat shaped like it
        self.pending = len(self.params)              # parameters not ready yet this step
        self.submitted = False
        self.handle: Any = None
        self.compressed: Any = None
        self.ctx: Any = None
        if len(self.params) > 1:
            p0 = self.params[0]
            total = sum(p.numel() for p in self.params)
            self.flat = torch.zeros(total, dtype=p0.dtype, device=p0.device)
            off = 0
            for p in self.params:
                n = p.numel()
                self.views[p] = self.flat[off:off + n].view(p.shape)
                off += n

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def reset(self) -> None:
        self.pending = len(self.params)
        self.submitted = False
        self.handle = self.compressed = self.ctx = None

    def load(self, p: torch.Tensor, views: bool) -> None:
        """Put p's gradient into its slice of the buffer (zeros when it has none)."""
        v = self.views[p]
        g = p.grad
        if g is None:
            v.zero_()
            p.grad = v if views else torch.zeros_like(p)
            return
        if g.data_ptr() == v.data_ptr() and g.shape == v.shape and g.stride() == v.stride():
            return                                   # accumulated in place already
        if g.is_sparse:
            g = g.to_dense()
            if not views:
                p.grad = g
        v.copy_(g)
        if views:
            p.grad = v                               # the autograd tensor is free now

    def __repr__(self) -> str:
        return f"<Bucket {self.name} {len(self.params)} params {self.nbytes} B>"


def _range_name(index: int, names: list, label: str = "bucket") -> str:
    first, last = names[0], names[-1]
    inner = first if len(names) == 1 else f"{first}..{last}"
    return f"grad.{label}{index}[{inner}]"


def make_buckets(params: list, names: dict, groups: Any, caps: tuple) -> list:
    """Partition ``params`` (registration order) into buckets; ``names``: id(param) -> name.

    ``groups`` (int or list of lists) makes each group a bucket (split by dtype/device if
    it mixes them); the rest, and everything when ``groups`` is None, are packed by size
    in reverse registration order: a bucket is closed once it holds >= its cap; a parameter
    of >= the cap by itself gets a bucket of its own (no copy into a buffer) and the open
    bucket stays open. ``caps == (0, 0)``: one bucket per parameter.
    """
    order = {id(p): i for i, p in enumerate(params)}
    lists: list = []            # lists of params, each a bucket (before dtype/device split)
    rest = params
    if groups is not None:
        if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
            raise TypeError("groups must be an int (number of groups) or a list of lists of parameters")
        if isinstance(groups, int):
            if groups < 1:
                raise ValueError(f"groups must be >= 1, got {groups}")
            n = min(groups, len(params)) or 1
            per = -(-len(params) // n)
            glists: Sequence = [params[i:i + per] for i in range(0, len(params), per)]
        else:
            glists = groups
        seen: set = set()
        for g in glists:
            members = []
            for q in g:
                if id(q) not in order:
                    continue
                if id(q) in seen:
                    raise ValueError("a parameter appears in more than one of `groups`")
                seen.add(id(q))
                members.append(q)
            if members:
                lists.append(members)
        rest = [p for p in params if id(p) not in seen]

    sized: list = []
    if caps == (0, 0):
        sized = [[p] for p in reversed(rest)]
    else:
        open_: dict = {}        # (device, dtype) -> [params, bytes, index among this key's buckets]
        for p in reversed(rest):
            key = (str(p.device), p.dtype)
            cur = open_.get(key)
            if cur is None:
                cur = open_[key] = [[], 0, 0]
            nbytes = p.numel() * p.element_size()
            cap = caps[0] if cur[2] == 0 else caps[1]
            if nbytes >= cap:   # fills a bucket alone: reduced in p.grad itself, no copies
                sized.append([p])
                cur[2] += 1
                continue
            cur[0].append(p)
            cur[1] += nbytes
            if cur[1] >= cap:
                sized.append(cur[0])
                open_[key] = [[], 0, cur[2] + 1]
        sized += [cur[0] for cur in open_.values() if cur[0]]

    out: list = []
    for label, group_lists in (("group", lists), ("bucket", sized)):
        k = 0
        for members in group_lists:
            # a flat buffer needs one dtype and device: split a mixed group
            by_key: dict = {}
            for q in members:
                by_key.setdefault((str(q.device), q.dtype), []).append(q)
            for sub in by_key.values():
                if len(sub) == 1:
                    name = names[id(sub[0])]
                else:
                    reg = sorted(sub, key=lambda q: order[id(q)])
                    name = _range_name(k, [names[id(q)] for q in reg], label)
                    k += 1
                out.append(Bucket(len(out), sub, name))
    return out


def check_same_layout(buckets: list, process_set: Any) -> None:
    """Every rank must cut its gradients into the same buckets (same names, shapes, dtypes);
    otherwise the ranks would submit differently named requests and stall. One small
    allgather at construction turns that into a clear error on every rank. A rank that joined
    a running elastic job skips it: the others built their optimizers long before."""
    from hvd_magic.collectives.elastic import spawned
    if spawned():
        return
    layout = [(b.name, [(tuple(p.shape), str(p.dtype)) for p in b.params]) for b in buckets]
    digest = hashlib.sha1(repr(layout).encode()).hexdigest()
    everyone = C.allgather_object((digest, layout), name="DistributedOptimizer.layout",
                                  process_set=process_set)
    if len({d for d, _ in everyone}) == 1:
        return
    ref = everyone[0][1]
    differ = [r for r, (_, lay) in enumerate(everyone) if lay != ref]
    first = next(((i, [lay[i] if i < len(lay) else None for _, lay in everyone])
                  for i in range(max(len(lay) for _, lay in everyone))
                  if len({repr(lay[i]) if i < len(lay) else "-" for _, lay in everyone}) > 1), None)
    detail = ""
    if first is not None:
        i, per_rank = first
        detail = "; first difference, bucket %d: %s" % (i, "; ".join(
            f"rank {r}: {v[0] if v else 'none'} {[sh for sh, _ in v[1]] if v else ''}"
            for r, v in enumerate(per_rank)))
    raise C.TensorMismatchError(
        "DistributedOptimizer: the ranks' models differ (parameter shapes or dtypes), so their "
        f"gradients cannot be averaged; rank(s) {differ} differ from rank 0{detail}. Build the "
        "same model on every rank (and hvd.broadcast_parameters from rank 0).")
