"""Runtime settings of a rank, from Horovod's environment variables (and hvd_magic's own)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import config as env


@dataclass
class Config:
    """Runtime settings, from Horovod's environment variables (:meth:`from_env`; their
    defaults are declared once, in ``hvd_magic/config.py``)."""

    cycle_time_s: float
    fusion_threshold: int
    allreduce_chunk: int          # bytes per MPI call for big allreduces; 0: one call
    cache_capacity: int           # requests remembered per rank; 0: no caching
    stall_check_s: float          # 0 disables the warning
    stall_shutdown_s: float       # 0: never fail stalled requests
    cpu_operations: str
    timeline: str
    timeline_mark_cycles: bool
    autotune: bool
    autotune_log: str
    autotune_warmups: int
    autotune_steps_per_sample: int
    autotune_max_trials: int
    autotune_fixed: tuple         # knobs set explicitly: "fusion", "cycle"

    @classmethod
    def from_env(cls) -> "Config":
        """From the environment (declared, with their defaults, in hvd_magic/config.py)."""
        stall = env.get("HOROVOD_STALL_CHECK_TIME_SECONDS")
        if env.get("HOROVOD_STALL_CHECK_DISABLE"):
            stall = 0.0
        return cls(
            cycle_time_s=env.get("HOROVOD_CYCLE_TIME") / 1000.0,
            fusion_threshold=env.get("HOROVOD_FUSION_THRESHOLD"),
            allreduce_chunk=max(0, int(env.get("HVD_MAGIC_ALLREDUCE_CHUNK_MB") * 2**20)),
            cache_capacity=max(0, env.get("HOROVOD_CACHE_CAPACITY")),
            stall_check_s=stall,
            stall_shutdown_s=env.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
            cpu_operations=env.get("HOROVOD_CPU_OPERATIONS"),
            # (Horovod's DYNAMIC: no file now; hvd.start_timeline may start one later)
            timeline="" if env.get("HOROVOD_TIMELINE") == "DYNAMIC" else env.get("HOROVOD_TIMELINE"),
            timeline_mark_cycles=env.get("HOROVOD_TIMELINE_MARK_CYCLES"),
            autotune=env.get("HOROVOD_AUTOTUNE"),
            autotune_log=env.get("HOROVOD_AUTOTUNE_LOG"),
            autotune_warmups=env.get("HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
            autotune_steps_per_sample=env.get("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"),
            autotune_max_trials=env.get("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
            autotune_fixed=tuple(k for k, name in (("fusion", "HOROVOD_FUSION_THRESHOLD"),
                                                   ("cycle", "HOROVOD_CYCLE_TIME"))
                                 if env.is_set(name)),
        )
