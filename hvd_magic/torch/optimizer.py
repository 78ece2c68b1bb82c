"""``DistributedOptimizer``: averages gradients over all ranks while backward still runs.

Each parameter's gradient allreduce starts as soon as autograd has accumulated it
(``register_post_accumulate_grad_hook``), in place and in the background; ``step()``
waits for all of them and then runs the wrapped optimizer's step. Every rank's
``p.grad`` holds the average of all ranks' gradients when the step runs::

    rank 0: p.grad = [1., 2.]   rank 1: p.grad = [3., 4.]
    after optimizer.synchronize() (or inside step()): p.grad = [2., 3.] on both ranks

Gradients are bucketed (see :mod:`hvd_magic.torch.buckets`, ``HVD_MAGIC_BUCKET_BYTES``):
the runtime sees one flat request per bucket of about 1-4 MiB, not one per parameter.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch

import hvd_magic.collectives as C
from hvd_magic.collectives import Adasum, Average, ProcessSet, Sum, global_process_set
from hvd_magic.collectives.elastic import fault_tolerant
from hvd_magic.collectives.ops import to_op

from .buckets import Bucket, bucket_caps, check_same_layout, grad_views_enabled, make_buckets
from .compression import Compression, Compressor
from .sparse import reduce_sparse_grad_async


class _DistributedOptimizer:
    """Mixin placed before the wrapped optimizer's class in a dynamic subclass."""

    # set by _setup
    _hvd_names: dict
    _hvd_buckets: list            # Bucket objects, in creation order
    _hvd_bucket_of: dict          # param -> its Bucket
    _hvd_delay: dict              # param -> local passes left before its gradient is final

    def _hvd_setup(self, named_parameters: Optional[Iterable], compression: type[Compressor],
                   backward_passes_per_step: int, op: Any, gradient_predivide_factor: float,
                   groups: Any, sparse_as_dense: bool, process_set: ProcessSet) -> None:
        self._hvd_ps = process_set
        self._hvd_reduces = reduces = _reduces(process_set)
        all_params = [p for g in self.param_groups for p in g["params"]]
        names = _param_names(self.param_groups, named_parameters)
        self._parameter_names = {p: names[id(p)] for p in all_params}   # (Horovod's attribute)
        op = to_op(op)
        factor = float(gradient_predivide_factor)
        self._hvd_names = names
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_op = op
        self._hvd_prescale = 1.0 / factor if op == Average else 1.0
        self._hvd_postscale = factor if op == Average else 1.0
        self._hvd_sparse_as_dense = bool(sparse_as_dense)
        self._hvd_requires = [p for p in all_params if p.requires_grad]
        self._hvd_views = grad_views_enabled()
        self._hvd_buckets = make_buckets(self._hvd_requires, names, groups,
                                         bucket_caps() if reduces else (0, 0))
        self._hvd_bucket_of = {p: b for b in self._hvd_buckets for p in b.params}
        if _set_size(process_set) > 1:
            check_same_layout(self._hvd_buckets, process_set)
        self._hvd_delay = {p: backward_passes_per_step for p in self._hvd_requires}
        self._hvd_should_sync = True
        self._hvd_synchronized = False
        self._hvd_fired = 0              # hook calls since the last synchronize
        self._hvd_sparse_dims: dict = {}  # param -> sparse_dim of its (sparse) gradients
        self._hvd_side: dict = {}        # param -> finisher of its sparse reduction this step
        if reduces:
            hook = _weak_hook(self)
            for p in self._hvd_requires:
                # A parameter serves one DistributedOptimizer: the newest (a notebook cell run
                # again must not leave the previous wrapper reducing the same gradients).
                old = getattr(p, "_hvd_magic_hook", None)
                if old is not None:
                    old.remove()
                p._hvd_magic_hook = p.register_post_accumulate_grad_hook(hook)

    # ------------------------------------------------------------------ hooks
    def _hvd_hook(self, p: torch.Tensor) -> None:
        b = self._hvd_bucket_of[p]
        if b.submitted or self._hvd_delay[p] <= 0:
            raise RuntimeError(
                f"the gradient of '{self._hvd_names[id(p)]}' was computed more than "
                f"backward_passes_per_step={self._hvd_passes} time(s) before optimizer.step(); "
                "call step() (or synchronize()) after every backward, or raise "
                "DistributedOptimizer(..., backward_passes_per_step=...) to accumulate more passes "
                "locally")
        self._hvd_fired += 1
        self._hvd_delay[p] -= 1
        if self._hvd_delay[p] == 0:
            if self._hvd_is_sparse(p):
                self._hvd_submit_sparse(p, b)
            else:
                if b.flat is not None:
                    b.load(p, self._hvd_views)
                b.pending -= 1
            if b.pending == 0:
                self._hvd_submit(b)

    def _hvd_is_sparse(self, p: torch.Tensor) -> bool:
        return p in self._hvd_sparse_dims or (p.grad is not None and p.grad.is_sparse)

    def _hvd_submit_sparse(self, p: torch.Tensor, b: Bucket) -> None:
        """A sparse gradient is reduced on its own, as Horovod's (allgather of its entries, or
        densified with sparse_as_dense); its slice of the bucket's buffer is sent as zeros."""
        dims = self._hvd_sparse_dims.setdefault(p, p.grad.sparse_dim() if p.grad is not None else 1)
        self._hvd_side[p] = reduce_sparse_grad_async(
            p.grad, p, self._hvd_names[id(p)], self._hvd_op, dims, self._hvd_sparse_as_dense,
            self._hvd_compression, self._hvd_ps, self._hvd_prescale, self._hvd_postscale)
        self._hvd_delay[p] = 0
        b.pending -= 1
        if b.flat is None:
            b.submitted = True           # (no bucket request: handle stays None)
        else:
            b.views[p].zero_()

    def _hvd_submit(self, b: Bucket) -> None:
        if b.submitted:
            return
        if b.flat is None:
            p = b.params[0]
            if p.grad is None:   # no gradient on this rank (unused parameter): contribute zeros
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            tensor = p.grad
        else:
            if b.pending:        # synchronize(): parameters whose hook did not complete
                for p in b.params:
                    if self._hvd_delay[p] > 0:
                        b.load(p, self._hvd_views)
            tensor = b.flat
        b.compressed, b.ctx = self._hvd_compression.compress(tensor)
        b.handle = C.allreduce_async_(b.compressed, name=b.name, op=self._hvd_op,
                                      prescale_factor=self._hvd_prescale,
                                      postscale_factor=self._hvd_postscale,
                                      process_set=self._hvd_ps)
        b.submitted = True

    # ------------------------------------------------------------------ public
    def synchronize(self) -> None:
        """Wait until every gradient is averaged over all ranks. Parameters whose gradient
        was not computed on this rank (unused in its forward pass) contribute zeros."""
        if not self._hvd_reduces:
            self._hvd_synchronized = True
            return
        try:
            for b in self._hvd_buckets:
                if b.pending and not b.submitted:
                    for p in b.params:
                        if self._hvd_delay[p] > 0 and self._hvd_is_sparse(p):
                            self._hvd_submit_sparse(p, b)
                self._hvd_submit(b)
            err: Optional[BaseException] = None
            for p, finish in self._hvd_side.items():
                try:
                    p.grad = finish()
                except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
                    err = err or exc
            for b in self._hvd_buckets:
                if b.handle is None:         # its one parameter's gradient is sparse
                    continue
                try:
                    out = b.handle.wait()
                except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
                    err = err or exc
                    continue
                target = b.params[0].grad if b.flat is None else b.flat
                if b.compressed is not target:
                    target.copy_(self._hvd_compression.decompress(out, b.ctx))
                if b.flat is not None and not self._hvd_views:
                    dense = [p for p in b.params if p not in self._hvd_side]
                    torch._foreach_copy_([p.grad for p in dense], [b.views[p] for p in dense])
            if err is not None:
                raise err
        finally:
            for b in self._hvd_buckets:
                b.reset()
            self._hvd_fired = 0
            self._hvd_side.clear()
            for p in self._hvd_requires:
                self._hvd_delay[p] = self._hvd_passes
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize; use after an explicit
        ``synchronize()``, e.g. to clip the averaged gradients::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure: Any = None) -> Any:
        """Wait for the gradients' allreduces, then run the wrapped optimizer's step."""
        if self._hvd_should_sync:
            if self._hvd_synchronized and not self._hvd_fired:
                # (the first sentence is Horovod's, which scripts and tests match)
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(); gradients are reduced "
                              "again (wrap step() in `with optimizer.skip_synchronize():`)")
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or with ``set_to_none``, drop) the gradients. Not allowed while allreduces
        of them are in flight (between backward and step)."""
        if self._hvd_fired:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(); the gradients are "
                               "being reduced or accumulated for the next step. Call step() or "
                               "synchronize() first")
        super().zero_grad(set_to_none=set_to_none)


class _DistributedAdasumOptimizer:
    """Mixin for ``op=hvd.Adasum`` (Horovod's delta optimizer): ``step()`` runs the wrapped
    optimizer's step on this rank's own gradients, then sets each parameter to its value
    before the step plus the Adasum over all ranks of its change (no division by the number
    of ranks). With SGD and learning rate lr, 2 ranks::

        rank 0: p = [0., 0.], p.grad = [1., 0.]   rank 1: p = [0., 0.], p.grad = [0., 1.]
        after step(): p = [-lr, -lr] on both ranks (orthogonal changes are summed)
        with p.grad = [1., 1.] on both ranks instead: p = [-lr, -lr] (equal changes: one)
    """

    def _hvd_adasum_setup(self, named_parameters: Optional[Iterable], compression: type[Compressor],
                          backward_passes_per_step: int, process_set: ProcessSet) -> None:
        self._hvd_ps = process_set
        self._hvd_reduces = _reduces(process_set)
        names = _param_names(self.param_groups, named_parameters)
        self._hvd_names = names
        self._parameter_names = {p: names[id(p)] for g in self.param_groups for p in g["params"]}
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_requires = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        for p in self._hvd_requires:     # the newest wrapper of a parameter serves it alone
            old = getattr(p, "_hvd_magic_hook", None)
            if old is not None:
                old.remove()
                p._hvd_magic_hook = None
        if _set_size(process_set) > 1:
            check_same_layout([Bucket(i, [p], names[id(p)]) for i, p in enumerate(self._hvd_requires)],
                              process_set)

    def synchronize(self) -> None:
        """Nothing to do: with Adasum the parameters' changes are reduced inside ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise ValueError("skip_synchronize() is not available with op=hvd.Adasum (as in Horovod): "
                         "step() applies the local update and reduces its result; clip the local "
                         "gradients before step() instead")
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's step on the local gradients, then the Adasum of every
        rank's parameter change added to the parameters as they were before the step."""
        if not self._hvd_reduces:
            return super().step(closure)  # type: ignore[misc]
        params = self._hvd_requires
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
        loss = super().step(closure)  # type: ignore[misc]
        comp = self._hvd_compression
        with torch.no_grad():
            pending = []
            for p, s in zip(params, start):
                delta = p.detach() - s
                if delta.device.type != "cpu":   # Adasum runs over MPI: through host memory
                    delta = delta.cpu()
                sent, ctx = comp.compress(delta)
                pending.append((C.allreduce_async_(sent, name=f"adasum.{self._hvd_names[id(p)]}",
                                                   op=Adasum, process_set=self._hvd_ps), ctx))
            err: Optional[BaseException] = None
            for p, s, (handle, ctx) in zip(params, start, pending):
                try:
                    delta = comp.decompress(handle.wait(), ctx)
                except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
                    err = err or exc
                    continue
                p.copy_(s.add_(delta.to(device=s.device, dtype=s.dtype)))
            if err is not None:
                raise err
        return loss


def _param_names(param_groups: list, named_parameters: Optional[Iterable]) -> dict:
    """id(parameter) -> the name of its allreduce, checked as Horovod checks them."""
    all_params = [p for g in param_groups for p in g["params"]]
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
            raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, "
                             "usually model.named_parameters()")
        seen: set = set()
        dups = sorted({k for k, _ in named if k in seen or seen.add(k)})
        if dups:
            raise ValueError("parameter names in named_parameters must be unique; duplicates: "
                             + ", ".join(map(str, dups)) + ". Pass model.named_parameters() of "
                             "a single model, or rename the parameters")
        named_ids = {id(v) for _, v in named}
        missing = [p for p in all_params if id(p) not in named_ids]
        if missing:
            raise ValueError(f"named_parameters was given but {len(missing)} parameter(s) of the "
                             f"optimizer are not in it (shapes {[tuple(p.shape) for p in missing]}); "
                             "pass the named_parameters() of every model whose parameters the "
                             "optimizer updates")
        names = {id(v): str(k) for k, v in named}
    else:
        names = {id(p): f"allreduce.noname.{i}.{j}"
                 for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])}
    return names


def _check_args(backward_passes_per_step: Any, op: Any, gradient_predivide_factor: Any,
                compression: Any) -> None:
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    op = to_op(op)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer reduces gradients with op=hvd.Average, hvd.Sum or "
                         f"hvd.Adasum, not {op.name}")
    factor = float(gradient_predivide_factor)
    if factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is only meaningful with op=hvd.Average")
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {factor}")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError("compression must be hvd.Compression.none, .fp16, .bf16 or a class "
                        "with compress/decompress")


def _weak_hook(opt: _DistributedOptimizer) -> Any:
    """The gradient hook, holding the optimizer weakly: a dropped optimizer stops reducing."""
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        o = ref()
        if o is not None:
            o._hvd_hook(p)
    return hook


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of a subclass of ``optimizer``'s class sharing its
    ``param_groups`` and ``state`` (so ``isinstance``, ``state_dict`` and LR schedulers
    work). ``named_parameters`` (``model.named_parameters()``) names the allreduces;
    ``backward_passes_per_step=k`` accumulates k local backward passes before reducing;
    ``op`` is hvd.Average or hvd.Sum; ``gradient_predivide_factor=f`` divides by f before
    the sum and by size/f after; ``groups`` (int or list of lists of parameters) reduces
    those gradients together (``num_groups=k``, Horovod's older spelling, is ``groups=k``).
    With ``process_set``, gradients are averaged over its ranks only; on a rank outside the
    set it is the plain local optimizer (as Horovod's).

    ``op=hvd.Adasum`` works as Horovod's Adasum optimizer: ``step()`` applies the local
    update, then each parameter's change is Adasum-reduced over the ranks and applied (see
    ``_DistributedAdasumOptimizer``; ``groups`` and ``sparse_as_dense`` do not apply).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(optimizer, (_DistributedOptimizer, _DistributedAdasumOptimizer)):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    _check_args(backward_passes_per_step, op, gradient_predivide_factor, compression)
    if num_groups and groups is None:
        groups = num_groups
    adasum = to_op(op) == Adasum
    base = type(optimizer)
    mixin = _DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)
    if adasum:
        opt._hvd_adasum_setup(named_parameters, compression, backward_passes_per_step, process_set)
    else:
        opt._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return opt


def _reduces(process_set: ProcessSet) -> bool:
    """Whether this rank reduces its gradients: with other ranks in the set, and also alone in
    an elastic job (MPI fault tolerance on), which may grow at a commit: a rank that joined
    would wait for the reductions of a first rank that skipped them."""
    return _set_size(process_set) > 1 or (process_set.process_set_id == 0 and fault_tolerant())


def _set_size(process_set: ProcessSet) -> int:
    """Ranks the gradients are reduced over (1 on a rank outside the set: it trains locally)."""
    if process_set.process_set_id == 0:
        return C.size()
    return process_set.size() if process_set.included() else 1
