"""``DistributedOptimizer``: averages gradients over all ranks while backward still runs.

Each parameter's gradient allreduce starts as soon as autograd has accumulated it
(``register_post_accumulate_grad_hook``), in place and in the background; ``step()``
waits for all of them and then runs the wrapped optimizer's step. Every rank's
``p.grad`` holds the average of all ranks' gradients when the step runs::

    rank 0: p.grad = [1., 2.]   rank 1: p.grad = [3., 4.]
    after optimizer.synchronize() (or inside step()): p.grad = [2., 3.] on both ranks
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

import hvd_magic.collectives as C
from hvd_magic.collectives import Adasum, Average, Sum
from hvd_magic.collectives.ops import to_op

from .compression import Compression, Compressor


class _DistributedOptimizer:
    """Mixin placed before the wrapped optimizer's class in a dynamic subclass."""

    # set by _setup
    _hvd_names: dict
    _hvd_bucket_of: dict          # param -> tuple of params reduced together
    _hvd_delay: dict              # param -> local passes left before its allreduce
    _hvd_inflight: dict           # param -> (handle or None, compressed tensor, ctx)
    _hvd_submitted: set           # ids of buckets already submitted this step

    def _hvd_setup(self, named_parameters: Optional[Iterable], compression: type[Compressor],
                   backward_passes_per_step: int, op: Any, gradient_predivide_factor: float,
                   groups: Any, sparse_as_dense: bool) -> None:
        all_params = [p for g in self.param_groups for p in g["params"]]
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
                     for i, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])}
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        op = to_op(op)
        if op == Adasum:
            raise ValueError("DistributedOptimizer(op=hvd.Adasum) is not supported by hvd_magic; "
                             "use op=hvd.Average (default) or op=hvd.Sum")
        if op not in (Average, Sum):
            raise ValueError(f"DistributedOptimizer reduces gradients with op=hvd.Average or hvd.Sum, "
                             f"not {op.name}")
        factor = float(gradient_predivide_factor)
        if factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor is only meaningful with op=hvd.Average")
        if factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {factor}")
        if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
            raise TypeError("compression must be hvd.Compression.none, .fp16, .bf16 or a class "
                            "with compress/decompress")
        self._hvd_names = names
        self._hvd_compression = compression
        self._hvd_passes = backward_passes_per_step
        self._hvd_op = op
        self._hvd_prescale = 1.0 / factor if op == Average else 1.0
        self._hvd_postscale = factor if op == Average else 1.0
        self._hvd_sparse_as_dense = bool(sparse_as_dense)
        self._hvd_requires = [p for p in all_params if p.requires_grad]
        self._hvd_bucket_of = _buckets(self._hvd_requires, groups)
        self._hvd_delay = {p: backward_passes_per_step for p in self._hvd_requires}
        self._hvd_inflight = {}
        self._hvd_submitted = set()
        self._hvd_ready: dict = {}
        self._hvd_should_sync = True
        self._hvd_synchronized = False
        self._hvd_fired = 0              # hook calls since the last synchronize
        if C.size() > 1:
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
        if p in self._hvd_inflight or self._hvd_delay[p] <= 0:
            raise RuntimeError(
                f"the gradient of '{self._hvd_names[id(p)]}' was computed more than "
                f"backward_passes_per_step={self._hvd_passes} time(s) before optimizer.step(); "
                "call step() (or synchronize()) after every backward, or raise "
                "DistributedOptimizer(..., backward_passes_per_step=...) to accumulate more passes "
                "locally")
        self._hvd_fired += 1
        self._hvd_delay[p] -= 1
        if self._hvd_delay[p] == 0:
            self._hvd_ready[p] = True
            bucket = self._hvd_bucket_of[p]
            if all(self._hvd_ready.get(q) for q in bucket):
                self._hvd_submit(bucket)

    def _hvd_submit(self, bucket: tuple) -> None:
        if id(bucket) in self._hvd_submitted:
            return
        self._hvd_submitted.add(id(bucket))
        for p in bucket:
            if p.grad is None:   # no gradient on this rank (unused parameter): contribute zeros
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            compressed, ctx = self._hvd_compression.compress(p.grad)
            handle = C.allreduce_async_(compressed, name=self._hvd_names[id(p)], op=self._hvd_op,
                                        prescale_factor=self._hvd_prescale,
                                        postscale_factor=self._hvd_postscale)
            self._hvd_inflight[p] = (handle, compressed, ctx)

    # ------------------------------------------------------------------ public
    def synchronize(self) -> None:
        """Wait until every gradient is averaged over all ranks. Parameters whose gradient
        was not computed on this rank (unused in its forward pass) contribute zeros."""
        if C.size() <= 1:
            self._hvd_synchronized = True
            return
        try:
            for p in self._hvd_requires:
                self._hvd_submit(self._hvd_bucket_of[p])
            err: Optional[BaseException] = None
            for p, (handle, compressed, ctx) in list(self._hvd_inflight.items()):
                try:
                    out = handle.wait()
                except BaseException as exc:  # noqa: BLE001 - wait for the rest, then raise
                    err = err or exc
                    continue
                if compressed is not p.grad:
                    p.grad.copy_(self._hvd_compression.decompress(out, ctx))
            if err is not None:
                raise err
        finally:
            self._hvd_inflight.clear()
            self._hvd_submitted.clear()
            self._hvd_ready.clear()
            self._hvd_fired = 0
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
            if self._hvd_synchronized and not self._hvd_inflight and not self._hvd_ready:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(); gradients are reduced again (wrap "
                              "step() in `with optimizer.skip_synchronize():`)")
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or with ``set_to_none``, drop) the gradients. Not allowed while allreduces
        of them are in flight (between backward and step)."""
        if self._hvd_inflight or self._hvd_fired:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(); the gradients are "
                               "being reduced or accumulated for the next step. Call step() or "
                               "synchronize() first")
        super().zero_grad(set_to_none=set_to_none)


def _weak_hook(opt: _DistributedOptimizer) -> Any:
    """The gradient hook, holding the optimizer weakly: a dropped optimizer stops reducing."""
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        o = ref()
        if o is not None:
            o._hvd_hook(p)
    return hook


def _buckets(params: list, groups: Any) -> dict:
    """param -> the tuple of params whose gradients are reduced together."""
    if groups is None:
        return {p: (p,) for p in params}
    if isinstance(groups, bool) or not isinstance(groups, (int, list, tuple)):
        raise TypeError("groups must be an int (number of groups) or a list of lists of parameters")
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        n = min(groups, len(params)) or 1
        per = -(-len(params) // n)
        lists: Sequence = [params[i:i + per] for i in range(0, len(params), per)]
    else:
        lists = groups
    out: dict = {}
    wanted = {id(p) for p in params}
    for g in lists:
        bucket = tuple(q for q in g if id(q) in wanted)
        for q in bucket:
            if q in out:
                raise ValueError("a parameter appears in more than one of `groups`")
            out[q] = bucket
    for p in params:
        out.setdefault(p, (p,))
    return out


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, groups: Any = None,
                         sparse_as_dense: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of a subclass of ``optimizer``'s class sharing its
    ``param_groups`` and ``state`` (so ``isinstance``, ``state_dict`` and LR schedulers
    work). ``named_parameters`` (``model.named_parameters()``) names the allreduces;
    ``backward_passes_per_step=k`` accumulates k local backward passes before reducing;
    ``op`` is hvd.Average or hvd.Sum; ``gradient_predivide_factor=f`` divides by f before
    the sum and by size/f after; ``groups`` (int or list of lists of parameters) reduces
    those gradients together.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)
    opt._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense)
    return opt
