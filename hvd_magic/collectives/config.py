"""Runtime settings of a rank, from Horovod's environment variables (and hvd_magic's own)."""
from __future__ import annotations

import os
from dataclasses import dataclass


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


@dataclass
class Config:
    """Runtime settings, from Horovod's environment variables."""

    cycle_time_s: float = 0.0
    fusion_threshold: int = 64 * 1024 * 1024
    allreduce_chunk: int = 1024 * 1024    # bytes per MPI call for big allreduces; 0: one call
    cache_capacity: int = 1024            # announcements remembered per rank; 0: no caching
    stall_check_s: float = 60.0          # 0 disables the warning
    stall_shutdown_s: float = 0.0        # 0: never fail stalled requests
    cpu_operations: str = "mpi"
    timeline: str = ""
    timeline_mark_cycles: bool = False

    @classmethod
    def from_env(cls) -> "Config":
        cpu_ops = os.environ.get("HOROVOD_CPU_OPERATIONS", "mpi").strip().lower() or "mpi"
        if cpu_ops not in ("mpi", "gloo"):
            raise ValueError(f"HOROVOD_CPU_OPERATIONS={cpu_ops!r}: use 'mpi' or 'gloo'")
        stall = _env_float("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0)
        if os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "") not in ("", "0"):
            stall = 0.0
        return cls(
            cycle_time_s=_env_float("HOROVOD_CYCLE_TIME", 0.0) / 1000.0,
            fusion_threshold=int(_env_float("HOROVOD_FUSION_THRESHOLD", 64 * 1024 * 1024)),
            allreduce_chunk=max(0, int(_env_float("HVD_MAGIC_ALLREDUCE_CHUNK_MB", 1.0) * 2**20)),
            cache_capacity=max(0, int(_env_float("HOROVOD_CACHE_CAPACITY", 1024))),
            stall_check_s=stall,
            stall_shutdown_s=_env_float("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0),
            cpu_operations=cpu_ops,
            timeline=os.environ.get("HOROVOD_TIMELINE", ""),
            timeline_mark_cycles=os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "") not in ("", "0"),
        )
