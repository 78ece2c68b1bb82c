"""Exceptions raised by the collective runtime.

Every error raised because ranks disagree, stall or fail is a subclass of
:class:`HvdError` (itself a ``RuntimeError``), raised on every rank that
takes part, with a message naming the operation, the tensor and the ranks.
"""
from __future__ import annotations


class HvdError(RuntimeError):
    """Base class of the runtime's cross-rank errors."""


# Horovod's name for the error a collective raises when the job is broken.
HorovodInternalError = HvdError


class TensorMismatchError(HvdError):
    """Ranks submitted the same tensor name with different shapes, dtypes, ops,
    root ranks or scale factors."""


class StallError(HvdError):
    """Some ranks submitted a tensor and others did not, for longer than
    ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``."""


class ShutdownError(HvdError):
    """The runtime was shut down (on this or another rank) while work was pending."""


class OpNotSupportedError(ValueError, RuntimeError):
    """An op the collective does not take (reducescatter with Adasum): a ValueError by the
    house rule for argument errors, and the RuntimeError Horovod raises there."""


class RankLostError(HvdError):
    """A rank died (MPI's fault tolerance reported it): ``hvd.elastic.run`` starts again on the
    survivors; outside it, the job cannot go on."""


def rank_lost_error(exc: BaseException, who: str, comm=None):
    """The error for pending work when the engine thread failed with ``exc``: a
    :class:`RankLostError` when MPI (or, under the gloo controller, a torch.distributed
    connection) reported a failed process, or when ``comm`` (the communicator the failed call
    ran on) was revoked, else None. (A revoked communicator can fail a nonblocking
    collective with MPI_ERR_OTHER: Open MPI's schedule stops with MPI_ERR_REVOKED inside and
    reports the request's error as OTHER.)"""
    if isinstance(exc, RankLostError):
        return exc
    from mpi4py import MPI
    if isinstance(exc, MPI.Exception):
        codes = [getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                           "ERR_REVOKED") if hasattr(MPI, n)]
        revoked = False
        if comm is not None and exc.Get_error_class() not in codes:
            try:
                revoked = bool(comm.Is_revoked())
            except Exception:  # noqa: BLE001 - no fault tolerance, or the communicator is freed
                pass
        if revoked or exc.Get_error_class() in codes:
            return RankLostError(f"a rank was lost: the collectives of {who} failed "
                                 f"({exc.Get_error_string()})")
    return None


class JoinedRankError(HvdError):
    """A collective that cannot run with joined ranks was submitted while some had joined."""


NOT_INITIALIZED = (
    "hvd_magic has not been initialized; call hvd.init() on every rank first "
    "(for example `import hvd_magic.torch as hvd; hvd.init()`)."
)


def group_ranks(values: dict[int, object]) -> str:
    """Describe per-rank values compactly: ``rank 0 sent (2,); ranks 1, 2 sent (3,)``."""
    by_value: dict[str, list[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(repr(values[rank]), []).append(rank)
    parts = []
    for value, ranks in by_value.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who} sent {value}")
    return "; ".join(parts)
