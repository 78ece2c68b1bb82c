"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

In training the mean and variance come from all ranks' samples together (one allreduce
of per-channel count, sum and sum of squares), so the output equals BatchNorm run on the
concatenated batch; backward allreduces the per-channel sums of ``dy`` and
``dy * (x - mean)``. Example, 2 ranks, one channel::

    rank 0: x = [1., 3.]   rank 1: x = [5., 7.]    -> mean 4, var 5 on both ranks
    rank 0: y = [-1.34, -0.45]   rank 1: y = [0.45, 1.34]
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import hvd_magic.collectives as C
from hvd_magic.collectives import Sum


def _shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):  # type: ignore[override]
        dims, shp = _dims(x), _shape(x)
        xf = x.detach().to(torch.float64)
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims),
                           torch.tensor([x.numel() / max(x.shape[1], 1)], dtype=torch.float64,
                                        device=x.device)])
        total = C.allreduce(local, op=Sum)
        c = x.shape[1]
        n = float(total[-1])
        if n <= 1:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel in training "
                             f"(got {n:g} over all ranks); use a bigger batch or eval mode")
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((var * n / (n - 1)).to(running_var.dtype),
                                                    alpha=momentum)
        mean_c, invstd_c = mean.to(x.dtype), invstd.to(x.dtype)
        y = (x - mean_c.view(shp)) * invstd_c.view(shp)
        if weight is not None:
            y = y * weight.view(shp) + bias.view(shp)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.n = n
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shp = _dims(x), _shape(x)
        xmu = x - mean.view(shp)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if weight is not None and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            c = x.shape[1]
            total = C.allreduce(torch.cat([sum_dy, sum_dy_xmu]).contiguous(), op=Sum)
            mean_dy, mean_dy_xmu = total[:c] / ctx.n, total[c:] / ctx.n
            w = weight.view(shp) if weight is not None else 1.0
            grad_x = (dy - mean_dy.view(shp) - xmu * (invstd * invstd * mean_dy_xmu).view(shp)) \
                * invstd.view(shp) * w
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover every rank's batch (any input of shape
    ``(N, C, ...)``). Same arguments as ``torch.nn.BatchNorm1d/2d/3d``; in eval mode it
    normalizes with the running statistics like them. Every rank must call forward (and
    backward) together in training."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of shape (N, C, ...), got {input.dim()}D "
                             f"input of shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or self.running_mean is None
        if not use_batch:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not C.is_initialized() or C.size() == 1 or not self.training:
            return F.batch_norm(input, self.running_mean if self.training else None,
                                self.running_var if self.training else None,
                                self.weight, self.bias, True, factor, self.eps)
        track = self.running_mean is not None and self.track_running_stats
        return _SyncBatchNormFn.apply(input, self.weight, self.bias,
                                      self.running_mean if track else None,
                                      self.running_var if track else None, self.eps, factor)
