"""Autotune (``HOROVOD_AUTOTUNE=1``): rank 0 tries fusion thresholds and cycle times during
the first steps of training, scores each by measured throughput, and settles on the best.

Deciding and doing are apart. :class:`Tuner` is pure: the collectives each cycle carried out
go in (names and bytes, with the time), the next setting to try comes out. The engine sends a
new setting in rank 0's next negotiation message and every rank applies it in the cycle that
message arrives in, before that cycle's fusion plan, so all ranks always fuse alike.

How a setting is scored is Horovod's: a *sample* ends when some tensor has been carried out
``steps_per_sample`` more times (about that many training steps), and scores the bytes its
collectives carried per microsecond; a *trial* is the median of :data:`SAMPLES` samples. The
first ``warmups`` trials (of the starting setting) are discarded: caches, allocators and
imports settle there.

The search is not Horovod's Bayesian optimisation but a coordinate search over fixed
candidates, which needs fewer trials for two knobs and is easy to follow in the log: the
starting setting, then every cycle time of :data:`CYCLE_MS` at the starting threshold, then
every threshold of :data:`FUSION_MB` at the best cycle time, then the :data:`CONFIRM` best
settings once more (on a shared machine one trial's score is noisy; a setting's score is the
mean of its trials), at most ``max_trials`` trials in all.
A knob the user set explicitly (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``) stays
fixed, as in Horovod. Each trial is a CSV row in Horovod's columns (``HOROVOD_AUTOTUNE_LOG``);
the last row is the setting chosen, with its score.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from .fusion import nbytes

CYCLE_MS = (0.0, 1.0, 2.5, 5.0, 10.0, 25.0)
FUSION_MB = (0.0, 0.5, 2.0, 8.0, 32.0, 64.0)
SAMPLES = 5
CONFIRM = 3
HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
          "cycle_time_ms,tensor_fusion_threshold,score")
MB = 1024 * 1024


@dataclass(frozen=True)
class Setting:
    """What autotune changes: the fusion threshold (MiB) and the cycle time (ms)."""

    fusion_mb: float
    cycle_ms: float

class Tuner:
    """Rank 0's search (pure: no clock, no MPI; rows go to ``log``).

    ``observe(tensors, now)`` returns the setting to try next when a trial ends (the best one,
    with :attr:`active` then False, when the search is over); ``applied(now)`` says it is in
    effect on every rank, which starts the next trial's clock.
    """

    def __init__(self, start: Setting, *, tune_fusion: bool = True, tune_cycle: bool = True,
                 warmups: int = 3, steps_per_sample: int = 10, max_trials: int = 20,
                 cache_enabled: bool = True, log: Optional[Callable[[str], None]] = None):
        self.current = start
        self.steps_per_sample = max(1, steps_per_sample)
        self.max_trials = max(1, max_trials)
        self.warmups_left = max(0, warmups)
        self.cache_enabled = cache_enabled
        self.log = log
        self.phases: List[str] = [p for p, on in (("cycle", tune_cycle), ("fusion", tune_fusion)) if on]
        self.active = bool(self.phases)
        self.trials: Dict[Setting, List[float]] = {}
        self.n_trials = 0
        self.confirming = False        # the last phase: the best settings measured again
        self.queue: List[Setting] = []
        self.waiting = False           # a new setting is on its way to the ranks
        self._start_sample(None)

    @property
    def scores(self) -> Dict[Setting, float]:
        """Each setting tried: the mean of its trials' scores."""
        return {s: statistics.fmean(v) for s, v in self.trials.items()}

    def _best(self) -> Setting:
        scores = self.scores
        return max(scores, key=scores.__getitem__)

    # -- the search
    def _start_sample(self, now: Optional[float]) -> None:
        self.counts: Dict[str, int] = {}
        self.sample = 0
        self.samples: List[float] = []
        self.bytes = 0
        self.t0 = now

    def applied(self, now: float) -> None:
        self.waiting = False
        self._start_sample(now)

    def observe(self, tensors: Iterable[Tuple[str, int]], now: float) -> Optional[Setting]:
        """Count one cycle's collectives (name, bytes); a setting when a trial ends."""
        if not self.active or self.waiting:
            return None
        if self.t0 is None:
            self.t0 = now
        ended = False
        counts, limit = self.counts, (self.sample + 1) * self.steps_per_sample
        total = 0
        for name, nbytes in tensors:
            total += nbytes
            n = counts.get(name, 0) + 1
            counts[name] = n
            ended = ended or n > limit
        if ended:
            self.samples.append(self.bytes / max((now - self.t0) * 1e6, 1.0))
            self.sample += 1
            self.bytes, self.t0 = 0, now
        self.bytes += total
        if len(self.samples) < SAMPLES:
            return None
        return self._trial_done(statistics.median(self.samples), now)

    def _trial_done(self, score: float, now: float) -> Optional[Setting]:
        if self.warmups_left > 0:
            self.warmups_left -= 1
            self._start_sample(now)
            return None
        self.trials.setdefault(self.current, []).append(score)
        self.n_trials += 1
        self._write(self.current, score)
        nxt = self._next()
        if nxt is None:
            best = self._best()
            self._write(best, self.scores[best])
            self.active = False
            self.current = best
            return best
        self.current, self.waiting = nxt, True
        return nxt

    def _next(self) -> Optional[Setting]:
        while self.n_trials < self.max_trials:
            if self.queue:
                s = self.queue.pop(0)
                if self.confirming or s not in self.trials:
                    return s
            elif self.phases:
                base, phase = self._best(), self.phases.pop(0)
                self.queue = ([Setting(base.fusion_mb, c) for c in CYCLE_MS] if phase == "cycle"
                              else [Setting(f, base.cycle_ms) for f in FUSION_MB])
            elif not self.confirming and len(self.trials) > 1:
                self.confirming = True
                scores = self.scores
                self.queue = sorted(scores, key=scores.__getitem__, reverse=True)[:CONFIRM]
            else:
                return None
        return None

    def _write(self, s: Setting, score: float) -> None:
        if self.log is not None:
            self.log(f"0,0,0,{int(self.cache_enabled)},{s.cycle_ms:g},{s.fusion_mb:g},{score:.6g}")


def for_engine(cfg: Any, rank: int, set_id: int) -> Tuple[Optional[Tuner], Optional[dict]]:
    """The global process set's engine tunes (rank 0 decides); None, None without autotune."""
    if not cfg.autotune or set_id != 0:
        return None, None
    start = Setting(cfg.fusion_threshold / MB, cfg.cycle_time_s * 1000.0)
    tunes = not {"fusion", "cycle"} <= set(cfg.autotune_fixed)   # (both set: nothing to try)
    status = status_of((start.fusion_mb, start.cycle_ms, tunes, 1))
    if rank != 0 or not tunes:
        return None, status
    log = csv_writer(cfg.autotune_log) if cfg.autotune_log else None
    return Tuner(start, tune_fusion="fusion" not in cfg.autotune_fixed,
                 tune_cycle="cycle" not in cfg.autotune_fixed, warmups=cfg.autotune_warmups,
                 steps_per_sample=cfg.autotune_steps_per_sample,
                 max_trials=cfg.autotune_max_trials, cache_enabled=cfg.cache_capacity > 0,
                 log=log), status


def carried(responses: list) -> Iterator[Tuple[str, int]]:
    """(name, bytes) of each collective a cycle carried out."""
    for resp in responses:
        if resp.error is None:
            a = resp.first
            yield resp.name, nbytes(a) if a.shape is not None else 0


def message(s: Setting, tuner: Tuner) -> tuple:
    """A setting as rank 0's negotiation message carries it."""
    trial = tuner.n_trials + (1 if tuner.active else 0)
    return (s.fusion_mb, s.cycle_ms, tuner.active, trial)


def apply(msg: tuple, cfg: Any, tuner: Optional[Tuner], now: float) -> dict:
    """Put a setting from rank 0's message into this rank's runtime settings (and start rank
    0's next trial); returns its status."""
    fusion_mb, cycle_ms, active, trial = msg
    cfg.fusion_threshold = int(round(fusion_mb * MB))
    cfg.cycle_time_s = cycle_ms / 1000.0
    if tuner is not None:
        tuner.applied(now)
    return status_of(msg)


def status_of(msg: tuple) -> dict:
    """A setting message as ``autotune_status()`` shows it."""
    fusion_mb, cycle_ms, active, trial = msg
    return {"active": bool(active), "trial": trial, "fusion_mb": fusion_mb, "cycle_ms": cycle_ms}


def csv_writer(path: str) -> Callable[[str], None]:
    """Start Horovod's autotune log at ``path`` (header now); each call appends a row."""
    with open(path, "w") as f:
        f.write(HEADER + "\n")

    def write(row: str) -> None:
        with open(path, "a") as f:
            f.write(row + "\n")
    return write
