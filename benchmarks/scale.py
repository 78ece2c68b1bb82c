"""Coordination cost as the number of ranks grows: hvd_magic now, the same code before its
response cache, and raw MPI, measured at 2 to 32 real ranks, then modelled to 1,024.

    .venv/bin/python benchmarks/scale.py                 # 2, 4, 8, 16, 32 ranks (about 10 min)
    .venv/bin/python benchmarks/scale.py --quick         # 2, 4, 8 ranks
    .venv/bin/python benchmarks/scale.py --ranks 2,4,8,16,32,64 --before d612b1d

What runs, at each rank count (``mpiexec --oversubscribe``, shared memory, one host):

- ``now``: this checkout. A training-like loop of 50 named float32 tensors of mixed sizes
  (64 B to 48 KiB, 590 KiB in all), each step ``hvd.allreduce_async_(t, name=..., op=Sum)``
  for every tensor, then ``hvd.synchronize`` of every handle;
- ``before``: the same worker with ``PYTHONPATH`` on a git worktree of ``--before`` (default
  d612b1d, the runtime before the response cache: every cycle allgathers a 2 KiB slot from
  every rank); skipped when that commit is not in the repository;
- ``raw``: the same tensors, one blocking ``comm.Allreduce(IN_PLACE, t, SUM)`` each, as a user
  without hvd would write it; then the two coordination collectives alone, timed: the bit
  vector's ``Iallreduce`` (16 B, BAND) and the 2 KiB slot ``Iallgather`` of the code before.

Both hvd runs use ``HOROVOD_FUSION_THRESHOLD=0`` and ``HVD_MAGIC_ALLREDUCE_CHUNK_MB=0``: every
tensor is then one MPI allreduce of its own bytes, exactly the raw run's calls, so that the
bytes hvd sends beyond raw's are its coordination and nothing else (with fusion the data
calls would differ from raw's in size, and Open MPI picks its algorithm by size; the
coordination protocol itself does not change with fusion).

Bytes are counted by Open MPI's monitoring component (``OMPI_MCA_pml_monitoring_enable=2``),
which each rank writes at exit: lines ``I <from> <to> <N> bytes <M> msgs sent`` are the
point-to-point messages the collectives' algorithms really sent (the bytes on the wire,
reported here), lines ``C`` the logical count (a collective's buffer once per peer, whatever
the algorithm; shown as "logical"). A launch counts everything from start to exit, so each
point is launched at two step counts and the difference divided by the step difference is
the steady state per step; the worker prints its engine's cycle count so that the same
difference gives cycles per step and bytes per cycle. Each point is launched ``--repeats``
times (default 3; the recursive-doubling pair below once), the variants in another order
each round, and the medians are reported.
Byte counts are exact (they matched the protocol's to the byte); times on this small shared
VM with more ranks than its 2 cores are mostly the kernel's scheduling, printed but not to
be read as a network's.

A second algorithm variant (``rd``; ``--no-rd`` skips it) forces recursive doubling for both
MPI paths hvd uses: Open MPI's ``coll_tuned_allreduce_algorithm=3`` (the blocking data
allreduce) and ``coll_libnbc_iallreduce_algorithm=4`` (the non-blocking allreduce that
carries the response cache's bits). By default Open MPI's libnbc reduces the small bit
vector up a binomial tree to rank 0 and broadcasts it back (rank 0 sends it log2(ranks)
times, the other ranks fewer); with recursive doubling every rank sends it log2(ranks) times.

Then the model (:func:`cycle_cost`): bytes per rank and cycle from the protocol, checked
against the measured points, and time per cycle on a stated link extended to 128, 512 and
1,024 ranks, with its share of a ResNet-50-sized step.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import signal
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent

# 50 tensors of mixed sizes (float32 elements), all under the shared-memory path's 64 KiB.
SIZES = [16, 64, 256, 1024, 4096, 12288]
N_TENSORS = 50
SLOT = 2048                  # bytes per rank and cycle of the allgather before the cache
COORD_ROUNDS = 20           # timed rounds of the coordination collectives alone (raw runs)
LINK_BW = 25e9 / 8           # 25 Gbit/s in bytes/s
LINK_LAT = 5e-6              # 5 us per message step

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl": "self,sm", "OMPI_MCA_mpi_yield_when_idle": "1"}
RD_ENV = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
          "OMPI_MCA_coll_tuned_allreduce_algorithm": "3",     # recursive doubling
          "OMPI_MCA_coll_libnbc_iallreduce_algorithm": "4"}   # recursive doubling
HVD_ENV = {"HOROVOD_FUSION_THRESHOLD": "0", "HVD_MAGIC_ALLREDUCE_CHUNK_MB": "0"}


def tensor_elems() -> list:
    return [SIZES[i % len(SIZES)] for i in range(N_TENSORS)]


# ----------------------------------------------------------------------------- worker
def worker(mode: str, warmup: int, steps: int) -> None:
    """One MPI rank: ``warmup`` + ``steps`` steps of the loop; rank 0 prints one JSON line."""
    import numpy as np
    from mpi4py import MPI

    tensors = [np.ones(n, dtype=np.float32) for n in tensor_elems()]
    names = [f"scale.grad.{i}" for i in range(len(tensors))]
    comm = MPI.COMM_WORLD
    times = []
    info = {}
    if mode == "raw":
        def step():
            for t in tensors:
                comm.Allreduce(MPI.IN_PLACE, t, op=MPI.SUM)
    else:
        import hvd_magic.collectives as hvd
        from hvd_magic.collectives import state
        hvd.init()
        info["module"] = os.path.dirname(os.path.dirname(hvd.__file__))

        def step():
            hs = [hvd.allreduce_async_(t, name=nm, op=hvd.Sum) for t, nm in zip(tensors, names)]
            for h in hs:
                hvd.synchronize(h)
    for i in range(warmup + steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if mode == "raw":
        # The two coordination collectives alone, timed in this job: the response cache's
        # bit vector (50 slots: two words, AND) and the full messages' 2 KiB slot per rank.
        # Every launch runs the same count, so their bytes cancel in the launches' difference.
        vec, vec_out = np.ones(2, dtype=np.uint64), np.empty(2, dtype=np.uint64)
        slot = np.zeros(SLOT, dtype=np.uint8)
        slots = np.empty(SLOT * comm.Get_size(), dtype=np.uint8)
        bits, gather = [], []
        for _ in range(COORD_ROUNDS):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Iallreduce(vec, vec_out, op=MPI.BAND).Wait()
            t1 = time.perf_counter()
            comm.Iallgather(slot, slots).Wait()
            bits.append(t1 - t0)
            gather.append(time.perf_counter() - t1)
        info.update(bits_s=statistics.median(bits), gather_s=statistics.median(gather))
    else:
        eng = state.engine()
        info.update(cycles=eng.cycles, exchanges=getattr(eng, "exchanges", eng.cycles),
                    hits=getattr(getattr(eng, "cache", None), "hits", None))
        hvd.shutdown()
    if comm.Get_rank() == 0:
        info.update(step_s=statistics.median(times) if times else None)
        print("SCALE " + json.dumps(info), flush=True)


# ----------------------------------------------------------------------------- launching
def mpiexec() -> str:
    exe = BIN / "mpiexec"
    return str(exe) if exe.exists() else (shutil.which("mpiexec") or "mpiexec")


def read_prof(prefix: str, n: int) -> dict:
    """Bytes from the monitoring files, per rank: ``sent``/``recv``, what the collectives
    really put on the wire (lines ``I``: the point-to-point messages the collectives'
    algorithms sent), and ``lsent``, the logical count (lines ``C``: a collective's buffer
    once per peer, whatever the algorithm)."""
    sent, recv, lsent = [0] * n, [0] * n, [0] * n
    pat = re.compile(r"^([IC])\s+(\d+)\s+(\d+)\s+(\d+)\s+bytes")
    files = glob.glob(prefix + ".*.prof")
    if len(files) < n:
        raise RuntimeError(f"monitoring wrote {len(files)} of {n} profile files under "
                           f"{prefix}.*.prof; is Open MPI's pml monitoring component built?")
    for f in files:
        for line in open(f):
            m = pat.match(line)
            if m:
                a, b, nb = int(m.group(2)), int(m.group(3)), int(m.group(4))
                if m.group(1) == "I":
                    sent[a] += nb
                    recv[b] += nb
                else:
                    lsent[a] += nb
    return {"sent": sent, "recv": recv, "lsent": lsent}


def launch(n: int, mode: str, steps: int, warmup: int, env_extra: dict, pythonpath,
           tmp: str, timeout: float) -> dict:
    prefix = os.path.join(tmp, f"{mode}-{n}-{steps}-{time.monotonic_ns()}")
    env = dict(os.environ)
    env.update(MPI_ENV)
    env.update(env_extra)
    env.update(OMPI_MCA_pml_monitoring_enable="2", OMPI_MCA_pml_monitoring_enable_output="3",
               OMPI_MCA_pml_monitoring_filename=prefix)
    if mode != "raw":
        env.update(HVD_ENV)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    argv = [mpiexec(), "--oversubscribe", "--bind-to", "none", "-n", str(n), sys.executable,
            str(Path(__file__).resolve()), "--worker", "raw" if mode == "raw" else "hvd",
            "--steps", str(steps), "--warmup", str(warmup)]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout)
    line = [x for x in p.stdout.splitlines() if x.startswith("SCALE ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"{mode} at {n} ranks, {steps} steps: exit {p.returncode}; "
                           f"output ends:\n{p.stdout[-2000:]}")
    out = json.loads(line[-1][6:])
    out.update(read_prof(prefix, n))
    out["wall_s"] = time.monotonic() - t0
    return out


def measure(n: int, mode: str, env_extra: dict, pythonpath, tmp: str, short: int, long: int,
            warmup: int, timeout: float) -> dict:
    """Steady-state figures per step (long launch minus short launch)."""
    a = launch(n, mode, short, warmup, env_extra, pythonpath, tmp, timeout)
    b = launch(n, mode, long, warmup, env_extra, pythonpath, tmp, timeout)
    d = long - short
    per = {
        "sent0": (b["sent"][0] - a["sent"][0]) / d,
        "recv0": (b["recv"][0] - a["recv"][0]) / d,
        "sent_max": max(y - x for x, y in zip(a["sent"], b["sent"])) / d,
        "sent_mean": (sum(b["sent"]) - sum(a["sent"])) / n / d,
        "lsent0": (b["lsent"][0] - a["lsent"][0]) / d,
        "step_s": b["step_s"],
        "bits_s": b.get("bits_s"), "gather_s": b.get("gather_s"),
        "wall_s": a["wall_s"] + b["wall_s"],
    }
    if mode != "raw":
        per["cycles"] = (b["cycles"] - a["cycles"]) / d
        per["exchanges"] = (b["exchanges"] - a["exchanges"]) / d
        per["module"] = b.get("module")
    return per


# ----------------------------------------------------------------------------- model
def vector_bytes(slots: int) -> int:
    """The response cache's bit vector: word 0 and one 64-bit word per 64 slots."""
    return 8 * (1 + (slots + 63) // 64)


def cycle_cost(n: int, version: str, algorithm: str = "recursive_doubling", slots: int = 50,
               bw: float = LINK_BW, lat: float = LINK_LAT) -> dict:
    """Coordination of one cycle at ``n`` ranks: bytes rank 0 sends (``sent0``), the mean over
    ranks of what each sends (``sent``) and the time on a link of ``bw`` bytes/s and ``lat``
    s per message step (``time_s``). Pure.

    ``version``: ``now`` (a quiet cycle: one allreduce of the bit vector), ``miss`` (a cycle
    with something new: the bit vector and then the full messages, as before), ``before``
    (the allgather of a 2 KiB slot from every rank).
    ``algorithm`` of the bit vector's allreduce: ``recursive_doubling`` (every rank exchanges
    the whole vector log2 n times), ``binomial`` (a reduce up a binomial tree to rank 0 and a
    broadcast down it: rank 0 sends it log2 n times, the ranks 2(n-1) times in all), ``linear``
    (every rank sends to rank 0, which sends the result to each) or ``ring`` (reduce-scatter
    + allgather, 2(n-1) steps of vector/n bytes, at least one word each). Any allgather of
    the slots has every rank send (n-1) x 2 KiB; its time is taken at the bandwidth optimum
    in log2 n steps (recursive doubling; the ring takes n-1), which is generous to ``before``."""
    if n < 2:
        return {"sent0": 0, "sent": 0, "time_s": 0.0}
    steps_log = math.ceil(math.log2(n))
    vec = vector_bytes(slots)
    if algorithm == "recursive_doubling":
        b0 = b_mean = steps_log * vec
        b_time = steps_log * (lat + vec / bw)
    elif algorithm == "binomial":
        b0, b_mean = steps_log * vec, 2 * (n - 1) * vec / n
        b_time = 2 * steps_log * (lat + vec / bw)
    elif algorithm == "linear":
        b0, b_mean = (n - 1) * vec, 2 * (n - 1) * vec / n
        b_time = 2 * (lat + (n - 1) * vec / bw)
    elif algorithm == "ring":
        piece = max(8, vec / n)
        b0 = b_mean = 2 * (n - 1) * piece
        b_time = 2 * (n - 1) * (lat + piece / bw)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}: recursive_doubling, binomial, "
                         f"linear or ring")
    g_bytes = (n - 1) * SLOT
    g_time = steps_log * lat + g_bytes / bw
    if version == "now":
        return {"sent0": b0, "sent": b_mean, "time_s": b_time}
    if version == "before":
        return {"sent0": g_bytes, "sent": g_bytes, "time_s": g_time}
    if version == "miss":
        return {"sent0": b0 + g_bytes, "sent": b_mean + g_bytes, "time_s": b_time + g_time}
    raise ValueError(f"unknown version {version!r}: now, before or miss")


# ----------------------------------------------------------------------------- report
def fmt_b(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["hvd", "raw"], help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the counted ones")
    ap.add_argument("--ranks", default="2,4,8,16,32", help="rank counts (default 2,4,8,16,32)")
    ap.add_argument("--quick", action="store_true", help="2, 4 and 8 ranks only")
    ap.add_argument("--short", type=int, default=4, help="steps of the short launch")
    ap.add_argument("--long", type=int, default=16, help="steps of the long launch")
    ap.add_argument("--before", default="d612b1d",
                    help="commit of the runtime before the response cache ('' to skip)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="launch pairs per point; medians (default 3, the rd pair once)")
    ap.add_argument("--no-rd", action="store_true", help="skip the recursive-doubling variant")
    ap.add_argument("--step-s", type=float, default=0.25,
                    help="the ResNet-50-sized step the model's share is of (s)")
    ap.add_argument("--timeout", type=float, default=120.0, help="limit per launch (s)")
    ap.add_argument("--json", help="write the measured figures here")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.warmup, args.steps)
        return 0

    ranks = [2, 4, 8] if args.quick else [int(x) for x in args.ranks.split(",")]
    p = lambda *a: print(*a, flush=True)
    load = os.getloadavg()
    p(f"scale: ranks {ranks}, {N_TENSORS} tensors of {sorted(set(x * 4 for x in SIZES))} bytes "
      f"({sum(tensor_elems()) * 4:,} B a step), launches of {args.short} and {args.long} steps "
      f"after {args.warmup} warm-up; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")

    # a SIGTERM (run_all's time limit, kill) still removes the worktree and the files
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(f"scale: terminated (signal {a[0]})"))
    tmp = tempfile.mkdtemp(prefix="hvd-scale-")
    worktree = None
    try:
        if args.before:
            ok = subprocess.run(["git", "rev-parse", "--verify", "-q", args.before + "^{commit}"],
                                cwd=ROOT, stdout=subprocess.DEVNULL).returncode == 0
            if ok:
                worktree = os.path.join(tmp, "before")
                subprocess.run(["git", "worktree", "add", "--detach", "-q", worktree, args.before],
                               cwd=ROOT, check=True)
            else:
                p(f"scale: commit {args.before!r} not in this repository; 'before' skipped")
        variants = [("now", "now", {}, None)]
        if worktree:
            variants.append(("before", "before", {}, worktree))
        variants.append(("raw", "raw", {}, None))
        if not args.no_rd:
            variants += [("now rd", "now", RD_ENV, None), ("raw rd", "raw", RD_ENV, None)]
        runs = {}
        t_all = time.monotonic()
        for rep in range(args.repeats):
            # each round in another order, so that load and warm caches hit every variant;
            # the recursive-doubling pair (bytes to show the algorithm's effect) runs once
            todo = variants if rep == 0 else [v for v in variants if not v[0].endswith(" rd")]
            k = rep % len(todo)
            for n in ranks:
                for label, mode, extra, pp in todo[k:] + todo[:k]:
                    try:
                        r = measure(n, mode, extra, pp, tmp, args.short, args.long, args.warmup,
                                    args.timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        p(f"scale: {label} at {n} ranks failed: {str(e)[:600]}")
                        continue
                    runs.setdefault((n, label), []).append(r)
                    p(f"  {n:3d} ranks {label:7s} rank 0 sent {r['sent0']:10,.0f} B/step, "
                      f"received {r['recv0']:10,.0f}; cycles/step {r.get('cycles', 0):5.1f}; "
                      f"step {r['step_s'] * 1e3:8.2f} ms ({r['wall_s']:.0f} s)")
        res = {key: merge(rs) for key, rs in runs.items()}
        p(f"scale: measured in {time.monotonic() - t_all:.0f} s; load average now "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        for (n, label), r in res.items():
            if r.get("module"):
                p(f"  ({label} at {n} ranks ran hvd_magic from {r['module']})")
                break
        report(p, ranks, res, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({f"{n} {lab}": r for (n, lab), r in res.items()}, f, indent=1)
    finally:
        if worktree:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=ROOT)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def merge(rs: list) -> dict:
    """The median of each figure over a point's launches."""
    out = dict(rs[0])
    for k, v in rs[0].items():
        if isinstance(v, (int, float)):
            out[k] = statistics.median(r[k] for r in rs)
    out["launches"] = len(rs)
    return out


def coord(res: dict, n: int, label: str, raw_label: str):
    """Coordination per step and per cycle: hvd's bytes beyond raw MPI's for the same calls."""
    h, r = res.get((n, label)), res.get((n, raw_label))
    if h is None or r is None:
        return None
    cyc = h["cycles"] or float("nan")
    out = {"sent0": h["sent0"] - r["sent0"], "recv0": h["recv0"] - r["recv0"],
           "lsent0": h["lsent0"] - r["lsent0"],
           "sent_max": h["sent_max"] - r["sent_max"], "sent_mean": h["sent_mean"] - r["sent_mean"],
           "time": h["step_s"] - r["step_s"], "cycles": h["cycles"],
           "exchanges": h["exchanges"]}
    for k in ("sent0", "recv0", "sent_mean", "lsent0", "time"):
        out[k + "_cyc"] = out[k] / cyc
    return out


def report(p, ranks, res, args) -> None:
    p("")
    p("Per step (steady state) and per cycle, medians over the launches. Bytes on the wire")
    p("(monitoring's I lines); coordination = hvd's bytes beyond raw MPI's same 50 allreduce calls")
    p("(exact); logical = monitoring's C lines (a collective's buffer once per peer, whatever the")
    p("algorithm); time = hvd step - raw step (each launch's median step; with more ranks than")
    p("the 2 cores mostly the kernel's scheduling)")
    p("")
    p("| ranks | version | rank 0 sent B/step: hvd / raw MPI | coord. B/step rank 0 | "
      "coord. B/cycle "
      "sent (rank 0 / mean of ranks) | coord. B/cycle received (rank 0) | logical coord. B/cycle "
      "rank 0 | cycles/step (full msgs) | step ms hvd / raw | (hvd - raw) ms/cycle |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    for n in ranks:
        for label, raw_label in (("before", "raw"), ("now", "raw"), ("now rd", "raw rd")):
            c = coord(res, n, label, raw_label)
            if c is None:
                continue
            h, r = res[(n, label)], res[(n, raw_label)]
            p(f"| {n} | {label} | {fmt_b(h['sent0'])} / {fmt_b(r['sent0'])} | "
              f"{fmt_b(c['sent0'])} | "
              f"{fmt_b(c['sent0_cyc'])} / {fmt_b(c['sent_mean_cyc'])} | {fmt_b(c['recv0_cyc'])} | "
              f"{fmt_b(c['lsent0_cyc'])} | {c['cycles']:.1f} ({c['exchanges']:.1f}) | "
              f"{h['step_s'] * 1e3:.1f} / {r['step_s'] * 1e3:.1f} | {c['time_cyc'] * 1e3:.2f} |")
    p("")
    p("The coordination collectives alone, timed in the raw MPI jobs (median of "
      f"{COORD_ROUNDS}, us; scheduling-bound when the ranks outnumber the cores):")
    p("")
    p("| ranks | bit vector Iallreduce (16 B), default / rec. doubling | 2 KiB slot Iallgather "
      "(before's cycle) |")
    p("|---|---|---|")
    for n in ranks:
        r, d = res.get((n, "raw")), res.get((n, "raw rd"))
        if r is None or r.get("bits_s") is None:
            continue
        rd = f"{d['bits_s'] * 1e6:.0f}" if d and d.get("bits_s") is not None else "-"
        p(f"| {n} | {r['bits_s'] * 1e6:.0f} / {rd} | {r['gather_s'] * 1e6:.0f} |")
    # growth of rank 0's bytes per step from 2 to 16 ranks (the issue's check) and of what
    # each rank contributes per cycle from the fewest to the most ranks measured
    p("")
    top = max(ranks)
    for label in ("before", "now", "now rd"):
        raw_label = "raw rd" if "rd" in label else "raw"
        for lo, hi in ((2, 16),):
            a, b = res.get((lo, label)), res.get((hi, label))
            ca, cb = coord(res, lo, label, raw_label), coord(res, hi, label, raw_label)
            if a and b and ca and cb:
                raw_x = res[(hi, raw_label)]["sent0"] / res[(lo, raw_label)]["sent0"]
                p(f"{label}: from {lo} to {hi} ranks rank 0 sends {b['sent0'] / a['sent0']:.1f}x "
                  f"the bytes per step (data included; raw MPI alone {raw_x:.1f}x); its "
                  f"coordination {cb['sent0'] / ca['sent0']:.1f}x per step, "
                  f"{cb['sent0_cyc'] / ca['sent0_cyc']:.1f}x per cycle (logical count, C lines, "
                  f"data included: {b['lsent0'] / a['lsent0']:.1f}x)")
        ca, cb = coord(res, min(ranks), label, raw_label), coord(res, top, label, raw_label)
        if ca and cb:
            p(f"{label}: coordination each rank sends per cycle (mean of ranks) "
              f"{ca['sent_mean_cyc']:,.0f} B at {min(ranks)} ranks, "
              f"{cb['sent_mean_cyc']:,.0f} B at {top}")

    p("")
    p(f"Model ({cycle_cost.__name__}): bytes per rank and cycle from the protocol, against the "
      "measured coordination per cycle")
    p("")
    p("| ranks | before: model / measured | now, default (binomial): model rank 0 / measured | "
      "model mean / measured | now rd: model / measured (mean) |")
    p("|---|---|---|---|---|")
    for n in ranks:
        cb, cn, cr = (coord(res, n, "before", "raw"), coord(res, n, "now", "raw"),
                      coord(res, n, "now rd", "raw rd"))
        mb, mn, mr = (cycle_cost(n, "before"), cycle_cost(n, "now", "binomial"),
                      cycle_cost(n, "now", "recursive_doubling"))
        p(f"| {n} | {fmt_b(mb['sent'])} / {fmt_b(cb and cb['sent_mean_cyc'])} | "
          f"{fmt_b(mn['sent0'])} / {fmt_b(cn and cn['sent0_cyc'])} | "
          f"{fmt_b(mn['sent'])} / {fmt_b(cn and cn['sent_mean_cyc'])} | "
          f"{fmt_b(mr['sent'])} / {fmt_b(cr and cr['sent_mean_cyc'])} |")
    p("")
    p(f"Modelled on a {LINK_BW * 8 / 1e9:.0f} Gbit/s link with {LINK_LAT * 1e6:.0f} us per message "
      f"step, {N_TENSORS} cached slots ({vector_bytes(N_TENSORS)} B vector); ResNet-50-sized step "
      f"{args.step_s:.2f} s; share = cycles x time per cycle / step, for 5 and 150 cycles a step")
    p("")
    p("Assumptions: the link is the one of Horovod's published benchmark (25 Gbit/s RoCE), 5 us a")
    p("message step; the bit vector stays 16 B (a step's 50 tensors; ResNet-50's 161: 24 B);")
    p(f"the step is --step-s {args.step_s:g} s, about ResNet-50 at batch 64 on one")
    p("Pascal/Volta-class GPU in fp32 (~256 images/s; not measured here); its 25.6 M parameters")
    p("are 102 MB of fp32 gradients, two 64 MiB fusion buckets. Cycles a step: 5 (the gradients")
    p("ready in a few bursts) or 150 (a cycle every 1 ms, Horovod's default HOROVOD_CYCLE_TIME,")
    p("through a ~150 ms backward pass).")
    p("A miss is a cycle with something new: the bit vector, then the full messages as before.")
    p("")
    p("| ranks | before: B/cycle a rank sends, us/cycle | now (rec. doubling): B, us | now "
      "(binomial): B rank 0, us | a miss (rec. doubling): us | share before, 5 / 150 cycles | "
      "share now (rec. doubling), 5 / 150 cycles |")
    p("|---|---|---|---|---|---|---|")
    for n in [2, 16, 32, 128, 512, 1024]:
        b, w, t, m = (cycle_cost(n, "before"), cycle_cost(n, "now"),
                      cycle_cost(n, "now", "binomial"), cycle_cost(n, "miss"))
        sh = lambda x, c: f"{100 * c * x / args.step_s:.2g}%"
        p(f"| {n} | {b['sent']:,.0f}, {b['time_s'] * 1e6:.1f} | {w['sent']:,.0f}, "
          f"{w['time_s'] * 1e6:.1f} | {t['sent0']:,.0f}, {t['time_s'] * 1e6:.1f} | "
          f"{m['time_s'] * 1e6:.1f} | {sh(b['time_s'], 5)} / {sh(b['time_s'], 150)} | "
          f"{sh(w['time_s'], 5)} / {sh(w['time_s'], 150)} |")

if __name__ == "__main__":
    sys.exit(main())
