"""Runtime behaviour beyond single ops: before-init errors, topology, different submission
orders, names in flight, fusion read from the timeline (and threshold 0), HOROVOD_TIMELINE,
join with uneven data, sub-communicators, shutdown + init again.

usage: coll_misc.py TMPDIR   (a directory every rank can write; rank 0 writes timelines there)
Exits nonzero with one line per failed check, prefixed by the rank."""
import json
import os
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import hvd_magic.collectives as hvd

TMP = sys.argv[1]
WR, WN = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
FAILS = []
SECTION = ""


def fail(msg):
    FAILS.append(f"[{SECTION}] {msg}")


def check(cond, msg):
    if not cond:
        fail(msg)


def section(name):
    def deco(fn):
        global SECTION
        SECTION = name
        try:
            fn()
        except Exception:
            fail(f"raised\n{traceback.format_exc()}")
        return fn
    return deco


def with_env(**env):
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# ---------------------------------------------------------------- before init
@section("before init")
def _():
    check(not hvd.is_initialized(), "is_initialized() before init")
    for fn in (lambda: hvd.allreduce(np.ones(2)), lambda: hvd.rank(), lambda: hvd.size(),
               lambda: hvd.allgather_async(np.ones(2)), lambda: hvd.barrier(),
               lambda: hvd.broadcast_object(1), lambda: hvd.join(), lambda: hvd.start_timeline("x")):
        try:
            fn()
            fail("no error before init")
        except ValueError as e:
            check("hvd.init()" in str(e), f"before-init message lacks 'hvd.init()': {e}")


hvd.init()
r, n = hvd.rank(), hvd.size()


@section("topology")
def _():
    check(hvd.is_initialized(), "is_initialized() after init")
    check((r, n) == (WR, WN), f"rank/size {(r, n)} != world {(WR, WN)}")
    check(hvd.local_rank() == r and hvd.local_size() == n, f"local {hvd.local_rank()}/{hvd.local_size()}")
    check(hvd.cross_rank() == 0 and hvd.cross_size() == 1, f"cross {hvd.cross_rank()}/{hvd.cross_size()}")
    allt = hvd.allgather_object((hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                                 hvd.cross_size()))
    check(sorted(t[1] for t in allt) == list(range(n)), f"local ranks not a permutation: {allt}")
    check(len({t[2:] for t in allt}) == 1, f"local_size/cross differ: {allt}")
    check(hvd.mpi_built() and hvd.mpi_enabled(), "mpi_built")
    check(isinstance(hvd.mpi_threads_supported(), bool), "mpi_threads_supported")


# ---------------------------------------------------------------- submission orders
ORDERS = [["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"], ["a", "c", "b"]]


def val(k, name, size):
    return np.full(size, 10.0 * k + ord(name[-1]), dtype=np.float32)


@section("different orders")
def _():
    for rnd, size in enumerate((3, 5000, 100000)):      # small, single/fused, bigger
        order = ORDERS[r % len(ORDERS)]
        hs = {}
        for name in order:
            hs[name] = hvd.allreduce_async(val(r, name, size), name=f"order{rnd}.{name}", op=hvd.Sum)
        for name in reversed(order):
            got = hvd.synchronize(hs[name])
            ref = sum(val(k, name, size).astype(np.float64) for k in range(n))
            check(np.allclose(got, ref), f"size {size} tensor {name}: {got[:3]} != {ref[:3]}")
    # mixed kinds in different orders
    order = ORDERS[r % len(ORDERS)]
    hs = {}
    for name in order:
        if name == "a":
            hs[name] = hvd.allgather_async(np.full((r + 1, 2), r), name="mixed.a")
        elif name == "b":
            hs[name] = hvd.broadcast_async(np.full(4, r), root_rank=n - 1, name="mixed.b")
        else:
            hs[name] = hvd.allreduce_async(np.full(6000, r, np.int64), name="mixed.c", op=hvd.Max)
    check(np.array_equal(hvd.synchronize(hs["a"]), np.concatenate([np.full((k + 1, 2), k) for k in range(n)])),
          "mixed allgather")
    check(np.array_equal(hvd.synchronize(hs["b"]), np.full(4, n - 1)), "mixed broadcast")
    check(np.array_equal(hvd.synchronize(hs["c"]), np.full(6000, n - 1)), "mixed allreduce")
    # unnamed calls in the same order on every rank
    for i in range(5):
        check(np.allclose(hvd.allreduce(np.full(2, float(r + i))), (n - 1) / 2 + i), f"unnamed {i}")


@section("recurring cycles")
def _():
    # A loop repeats the same announcements: after the first step the decisions come from
    # the cycle cache. Results must follow each step's values, also when one rank's messages
    # match earlier ones and another's do not (a cache keyed on part of the bytes hangs),
    # with a late rank, and an error must come back every time.
    from hvd_magic.collectives import state
    cache = state.engine().cycle_cache
    hits0 = cache.hits
    for step in range(12):
        hs = [hvd.allreduce_async(np.full(k, float(r + step + k)), name=f"loop.{k}", op=hvd.Sum)
              for k in (1, 7, 300)]
        g = hvd.allgather_async(np.full((r + 1, 2), step), name="loop.g")
        for h, k in zip(hs, (1, 7, 300)):
            check(np.allclose(hvd.synchronize(h), sum(q + step + k for q in range(n))), f"step {step} loop.{k}")
        check(np.array_equal(hvd.synchronize(g), np.concatenate([np.full((q + 1, 2), step) for q in range(n)])),
              f"step {step} allgather")
        check(np.allclose(hvd.allreduce(np.full(3, float(step)), name="loop.one"), step), f"step {step} single")
    if os.environ.get("HOROVOD_CACHE_CAPACITY") == "0":
        check(cache.hits == hits0, f"HOROVOD_CACHE_CAPACITY=0, yet {cache.hits - hits0} cache hits")
        check(state.engine().cache is None, "HOROVOD_CACHE_CAPACITY=0, yet a response cache")
    else:
        # the allgather's cycles recur byte for byte; the named allreduces go by their bits
        check(cache.hits > hits0, f"no cycle was served from the cache ({cache.hits})")
        check(state.engine().cache.hits >= 3 * 11, "the allreduces were not announced by bits "
              f"({state.engine().cache.hits} from the response cache)")
    # the same loop, the last rank submitting one tensor late: rank 0's messages are those
    # of the steps before, the last rank's are not
    for step in range(3):
        hs = []
        for k in (1, 7, 300):
            if k == 300 and r == n - 1:
                time.sleep(0.05)
            hs.append(hvd.allreduce_async(np.full(k, float(r + step + k)), name=f"loop.{k}", op=hvd.Sum))
        g = hvd.allgather_async(np.full((r + 1, 2), step), name="loop.g")
        for h, k in zip(hs, (1, 7, 300)):
            check(np.allclose(hvd.synchronize(h), sum(q + step + k for q in range(n))), f"late-300 step {step} loop.{k}")
        hvd.synchronize(g)
    # the last rank submits later (values checked; the cycles differ from the kept ones)
    for step in range(3):
        if r == n - 1:
            time.sleep(0.05)
        check(np.allclose(hvd.allreduce(np.full(3, float(r)), name="loop.late", op=hvd.Sum), n * (n - 1) / 2),
              f"late step {step}")
    # a mismatch (rank 0's shape differs) twice in a row: an error both times
    for attempt in range(2):
        try:
            hvd.allreduce(np.ones(4 if r == 0 else 5), name="loop.bad")
            fail(f"mismatch attempt {attempt} did not raise")
        except hvd.TensorMismatchError as e:
            check("loop.bad" in str(e), f"mismatch message {e}")
    check(np.allclose(hvd.allreduce(np.full(3, 1.0), name="loop.one"), 1.0), "after the mismatch")
    # Unnamed calls (a new allreduce.noname.N every call) recur as the same bytes too: a loop
    # of them is served from the cache, each step under its own names and with its values.
    rcache = state.engine().cache        # (None with HOROVOD_CACHE_CAPACITY=0)
    hits0, bits0 = cache.hits, rcache.hits if rcache is not None else 0
    for step in range(10):
        x = np.full(5, float(r + step))
        hvd.allreduce_(x, op=hvd.Sum)
        y = hvd.allreduce(np.full(300, float(r * step)))
        hs = [hvd.allreduce_async(np.full(k, float(r + k + step)), op=hvd.Sum) for k in (2, 3)]
        g = hvd.grouped_allreduce([np.full(4, float(r + step)), np.full(6, float(step))], op=hvd.Max)
        rows = hvd.allgather(np.full((r + 1, 2), float(step)))
        check(np.array_equal(rows, np.concatenate([np.full((q + 1, 2), float(step)) for q in range(n)])),
              f"unnamed step {step} allgather")
        check(np.allclose(x, sum(q + step for q in range(n))), f"unnamed step {step} in place")
        check(np.allclose(y, step * (n - 1) / 2), f"unnamed step {step} Average")
        for h, k in zip(hs, (2, 3)):
            check(np.allclose(hvd.synchronize(h), sum(q + k + step for q in range(n))), f"unnamed step {step} async {k}")
        check(np.allclose(g[0], n - 1 + step) and np.allclose(g[1], step), f"unnamed step {step} grouped")
    if os.environ.get("HOROVOD_CACHE_CAPACITY") != "0":
        # the allreduces go by their bits (response cache), the allgather's cycles recur
        bits = rcache.hits - bits0
        check(cache.hits + bits >= hits0 + 20, f"unnamed loop: {cache.hits - hits0} cycles from "
              f"the cycle cache, {bits} requests from the response cache")
    # a mismatch inside an unnamed loop still fails on every rank, and the loop goes on
    for step in range(3):
        try:
            hvd.allreduce(np.ones(4 if (r == 0 and step == 1) else 5))
            check(step != 1, "unnamed mismatch did not raise")
        except hvd.TensorMismatchError as e:
            check(step == 1 and "allreduce.noname." in str(e), f"unnamed mismatch step {step}: {e}")


@section("a recurring lone allreduce")
def _():
    # A blocking allreduce whose cycle recurs (named or unnamed, several in turn as in a
    # training step), then the ways such a loop changes: another name with the same fields,
    # an unnamed call's number that skipped one, another rank's other shape (a mismatch
    # error on every rank), a late rank (the engine thread finishes the posted cycle), an
    # async request of another rank.
    for step in range(15):
        x = np.full(6, float(r + step))
        hvd.allreduce_(x, name="fast.a", op=hvd.Sum)
        check(np.allclose(x, sum(q + step for q in range(n))), f"fast.a step {step}: {x[:2]}")
        y = hvd.allreduce(np.full(6, float(r * step)))
        check(np.allclose(y, step * (n - 1) / 2), f"unnamed step {step}: {y[:2]}")
        z = hvd.allreduce(np.full(6, float(r)), name="fast.b", op=hvd.Max)
        check(np.allclose(z, n - 1), f"fast.b step {step}: {z[:2]}")
    # the fields of fast.a under another name: this rank's bytes differ
    x = np.full(6, float(r))
    hvd.allreduce_(x, name="fast.c", op=hvd.Sum)
    check(np.allclose(x, n * (n - 1) / 2), f"fast.c: {x[:2]}")
    # every rank skips one unnamed number (as a name taken but never sent would): this
    # rank's message is not the kept one, and the usual way pairs the calls
    from hvd_magic.collectives import api
    for step in range(2):
        api.request_name("allreduce", None)
        y = hvd.allreduce(np.full(6, float(r * step)))
        check(np.allclose(y, step * (n - 1) / 2), f"unnamed after a skipped number {step}: {y[:2]}")
    # rank 0 repeats fast.a, the others send another shape: an error on every rank, twice
    for attempt in range(2):
        try:
            hvd.allreduce_(np.ones(6 if r == 0 else 7), name="fast.a", op=hvd.Sum)
            fail(f"fast.a mismatch {attempt} did not raise")
        except hvd.TensorMismatchError as e:
            check("fast.a" in str(e), f"fast.a mismatch message: {e}")
    # the last rank late: the others' posted cycle is finished by their engine threads
    for step in range(3):
        if r == n - 1:
            time.sleep(0.03)
        x = np.full(6, float(r + step))
        hvd.allreduce_(x, name="fast.a", op=hvd.Sum)
        check(np.allclose(x, sum(q + step for q in range(n))), f"late fast.a step {step}")
    # rank 0 waits on fast.a while the others submit fast.b first, without waiting
    h = None if r == 0 else hvd.allreduce_async(np.full(6, float(r)), name="fast.b", op=hvd.Max)
    x = np.full(6, 1.0)
    hvd.allreduce_(x, name="fast.a", op=hvd.Sum)
    check(np.allclose(x, n), f"fast.a beside an async fast.b: {x[:2]}")
    z = hvd.synchronize(h) if h is not None else hvd.allreduce(np.full(6, 0.0), name="fast.b", op=hvd.Max)
    check(np.allclose(z, n - 1), f"async fast.b: {z[:2]}")


@section("announcement tables that fill up")
def _():
    # A name that changes every step fills the tables (capacity 12 here); a full table starts
    # again on every rank at the same message, the cycle cache is emptied with it, and the
    # steady names are indexed and served from the cache again.
    from hvd_magic.collectives import state
    before = os.environ.get("HOROVOD_CACHE_CAPACITY")
    hvd.shutdown()
    with_env(HOROVOD_CACHE_CAPACITY="12")
    hvd.init()
    eng = state.engine()
    for step in range(20):
        for j in range(step % 3 + 1):     # so the steady names land on other indices each time
            check(np.allclose(hvd.allreduce(np.full(3, float(r + step)), name=f"ep.{step}.{j}",
                                            op=hvd.Sum), sum(q + step for q in range(n))),
                  f"per-step name {step}.{j}")
        for k in ("steady.a", "steady.b"):
            check(np.allclose(hvd.allreduce(np.full(2, float(r * step)), name=k, op=hvd.Sum),
                              step * n * (n - 1) / 2), f"{k} step {step}")
    check(eng.codec.resets >= 2, f"tables started again {eng.codec.resets} times")
    check(eng.cycle_cache.hits + eng.cache.hits > 0, "nothing served from a cache between resets")
    hvd.shutdown()
    with_env(HOROVOD_CACHE_CAPACITY=before)
    hvd.init()


@section("large negotiation messages")
def _():
    # hundreds of requests with long names in one cycle: messages far above the 8 KiB slot
    long = "x" * 200
    for size in (4, 3000):
        order = list(range(300)) if r % 2 == 0 else list(reversed(range(300)))
        hs = {i: hvd.allreduce_async(np.full(size, float(r * i)), name=f"{long}.{size}.{i}") for i in order}
        for i in range(300):
            got = hvd.synchronize(hs[i])
            check(np.allclose(got, i * (n - 1) / 2), f"big message size {size} tensor {i}: {got[:2]}")


@section("read-only and odd inputs")
def _():
    ro = np.full(3000, float(r))
    ro.flags.writeable = False
    check(np.allclose(hvd.allreduce(ro, name="ro big"), (n - 1) / 2), "read-only big")
    check(np.allclose(hvd.allreduce(ro[:3], name="ro small"), (n - 1) / 2), "read-only small")
    bc = np.broadcast_to(np.float32(r), (50, 40))      # zero strides
    check(np.allclose(hvd.allreduce(bc, name="bcast view", op=hvd.Sum), sum(range(n))), "broadcast_to input")
    check(np.allclose(hvd.allgather(ro[:2], name="ro gather"), np.repeat(np.arange(n), 2)), "read-only gather")
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4) + r)
    check(np.allclose(hvd.allreduce(fortran, name="fortran"), np.arange(12.0).reshape(3, 4) + (n - 1) / 2),
          "fortran-order input")
    check(hvd.grouped_allreduce([], name="empty group") == [], "empty grouped_allreduce")


@section("name in flight")
def _():
    h = hvd.allreduce_async(np.full(10, float(r)), name="dup")
    try:
        hvd.allreduce_async(np.ones(10), name="dup")
        fail("second submission of 'dup' did not raise")
    except ValueError as e:
        check("dup" in str(e) and "in flight" in str(e), f"message: {e}")
    check(np.allclose(hvd.synchronize(h), (n - 1) / 2), "first 'dup' result")
    # reusable once finished
    check(np.allclose(hvd.allreduce(np.full(10, 1.0), name="dup"), 1.0), "reuse of finished name")


@section("results of big out-of-place allreduces")
def _():
    # Results of >= 256 KiB come from a pool of arrays reused once the user let go of them:
    # a result still held (directly, as a view, or as a torch tensor) must never be written.
    k = 1 << 18                                              # 1 MiB of float32
    held = []
    for i in range(6):
        res = hvd.allreduce(np.full(k, float(r + i)), name="big oop")   # Average
        check(np.allclose(res, (n - 1) / 2 + i), f"big Average round {i}")
        if i % 2 == 0:
            held.append((i, res[::2]))                       # keep a view of every other one
    for i, view in held:
        check(np.allclose(view, (n - 1) / 2 + i), f"held result {i} was overwritten")
    try:
        import torch
    except ImportError:
        return
    t = torch.from_numpy(hvd.allreduce(np.full(k, 1.0, np.float32), name="big t", op=hvd.Sum))
    for i in range(3):
        check(np.allclose(hvd.allreduce(np.full(k, 2.0, np.float32), name="big u", op=hvd.Sum),
                          2.0 * n), f"second big result {i}")
    check(bool((t == float(n)).all()), "a torch tensor over a result was overwritten")


def load_timeline(path):
    with open(path) as f:
        return json.load(f)


def xevents(events, phase=None):
    """The spans of a timeline file (Horovod's layout: a process row per tensor, a thread row
    per rank, begin/end pairs) as dicts: name, ts, dur, rank, row (the tensor's row name),
    args; ``phase``: only spans of that name."""
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and e["pid"] != 0}
    open_, out = {}, []
    for e in events:
        if e.get("ph") == "B":
            open_.setdefault((e["pid"], e["tid"]), []).append(e)
        elif e.get("ph") == "E":
            b = open_[(e["pid"], e["tid"])].pop()
            if phase is None or b["name"] == phase:
                out.append({"name": b["name"], "ts": b["ts"], "dur": e["ts"] - b["ts"],
                            "rank": b["tid"], "row": rows[b["pid"]], "args": b.get("args", {})})
    return out


def fusion_batch(tag, count=32, elems=2048):
    """count async allreduces of 8 KiB float32 , then wait for all."""
    hs = [hvd.allreduce_async(np.full(elems, float(r + i), np.float32), name=f"{tag}.{i}", op=hvd.Sum)
          for i in range(count)]
    for i, h in enumerate(hs):
        got = hvd.synchronize(h)
        check(np.allclose(got, sum(k + i for k in range(n))), f"{tag}.{i} value {got[:2]}")
    return [f"{tag}.{i}" for i in range(count)]


@section("fusion via start_timeline")
def _():
    path = os.path.join(TMP, "fusion.json")
    hvd.start_timeline(path)
    names = []
    for b in range(3):
        names += fusion_batch(f"fuse{b}")
    hvd.allreduce(np.ones(2), name="small one")
    hvd.stop_timeline()
    if r == 0:
        ev = load_timeline(path)
        ars = xevents(ev, "MPI_ALLREDUCE")
        check(ars, "no MPI_ALLREDUCE events")
        fused = [e for e in ars if len(e.get("args", {}).get("tensors", [])) >= 2]
        check(fused, f"no fused MPI_ALLREDUCE (tensors per call: "
                     f"{[len(e.get('args', {}).get('tensors', [])) for e in ars][:20]})")
        covered = {t for e in ars for t in e.get("args", {}).get("tensors", [])}
        check(set(names) <= covered, f"tensors missing from MPI_ALLREDUCE events: {set(names) - covered}")
        phases = {e["name"] for e in xevents(ev)}
        for p in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "MPI_ALLREDUCE",
                  "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"):
            check(p in phases, f"phase {p} missing (have {sorted(phases)})")
        ranks = {e["rank"] for e in xevents(ev)}
        check(ranks == set(range(n)), f"rank rows {ranks} != ranks")
        for k in range(n):
            kp = {e["name"] for e in xevents(ev) if e["rank"] == k}
            check({"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "MPI_ALLREDUCE"} <= kp,
                  f"rank {k} phases {kp}")
        rows = {e["args"]["name"] for e in ev if e.get("name") == "process_name" and e["pid"]}
        check({f"allreduce.{t}" for t in names} <= rows, f"tensor rows {sorted(rows)[:10]}")
    # recording is off after stop: a second start/stop gives a fresh valid file
    path2 = os.path.join(TMP, "fusion2.json")
    hvd.start_timeline(path2)
    hvd.allreduce(np.ones(3000), name="after restart")
    hvd.stop_timeline()
    if r == 0:
        ev = load_timeline(path2)
        rows = {e["row"] for e in xevents(ev)}
        check("allreduce.after restart" in rows and not any("fuse" in c for c in rows),
              f"second timeline has {sorted(rows)[:10]}")


@section("subscribe")
def _():
    got = []
    unsub = hvd.subscribe(got.extend)
    hvd.allreduce(np.ones(3000), name="sub.big")
    hvd.allreduce(np.ones(3), name="sub.small")
    deadline = time.monotonic() + 5
    small = "MPI_ALLREDUCE"
    while not any(e[1] == "sub.small" and e[2] == small for e in got) and time.monotonic() < deadline:
        time.sleep(0.01)
    seen = {(e[1], e[2]) for e in got}
    for want in (("sub.big", "NEGOTIATE"), ("sub.big", "QUEUE"), ("sub.big", "MPI_ALLREDUCE"),
                 ("sub.small", small)):
        check(want in seen, f"subscriber missed {want}: {sorted(seen)}")
    check(all(e[0] == r for e in got), "subscriber got another rank's events")
    unsub()
    got.clear()
    hvd.allreduce(np.ones(3000), name="sub.after")
    hvd.barrier()
    time.sleep(0.05)
    check(not got, f"events after unsubscribe: {got[:3]}")


@section("join with uneven data")
def _():
    # rank k does k+1 steps, then joins. Step i is contributed by ranks k >= i; a joined rank
    # counts as zeros, so Average divides by every rank (as Horovod's)
    for rep in range(2):
        for i in range(r + 1):
            hs = [
                ("avg small", hvd.allreduce_async(np.full(3, 10.0 * r + i), name=f"j{rep}.{i}.s")),
                ("avg big", hvd.allreduce_async(np.full(3000, 10.0 * r + i), name=f"j{rep}.{i}.b")),
                ("sum int big", hvd.allreduce_async(np.full(3000, r + 1, np.int64), name=f"j{rep}.{i}.i",
                                                    op=hvd.Sum)),
                ("avg int", hvd.allreduce_async(np.full(3000, 2 * r + 1, np.int32), name=f"j{rep}.{i}.a")),
                ("min big", hvd.allreduce_async(np.full(3000, float(r + 5)), name=f"j{rep}.{i}.m", op=hvd.Min)),
                ("max small", hvd.allreduce_async(np.full(2, -r - 1, np.int8), name=f"j{rep}.{i}.x", op=hvd.Max)),
            ]
            contrib = [k for k in range(n) if k >= i]
            refs = {"avg small": sum(10.0 * k + i for k in contrib) / n,
                    "avg big": sum(10.0 * k + i for k in contrib) / n,
                    "sum int big": sum(k + 1 for k in contrib),
                    "avg int": sum(2 * k + 1 for k in contrib) // n,
                    "min big": min(k + 5 for k in contrib),
                    "max small": max(-k - 1 for k in contrib)}
            for what, h in hs:
                got = hvd.synchronize(h)
                check(np.allclose(got, refs[what]),
                      f"rep {rep} step {i} {what}: got {got[:2]} want {refs[what]} (contributors {contrib})")
        last = hvd.join()
        check(last == n - 1, f"rep {rep}: join returned {last}, want {n - 1}")
        allv = hvd.allgather_object(last)
        check(len(set(allv)) == 1, f"join results differ across ranks: {allv}")
    check(np.allclose(hvd.allreduce(np.full(4, float(r))), (n - 1) / 2), "allreduce after join")
    # barrier counts joined ranks as arrived; broadcast cannot run with a joined rank
    if r == 0:
        hvd.join()
    else:
        hvd.barrier(name="barrier with joined")
        try:
            hvd.broadcast(np.ones(3), root_rank=1, name="bcast with joined")
            fail("broadcast with a joined rank did not raise")
        except hvd.JoinedRankError as e:
            check("'bcast with joined'" in str(e) and "rank(s) 0" in str(e), f"message {e}")
        try:     # as Horovod: allgather does not run with a joined rank either
            hvd.allgather(np.ones(2), name="ag with joined")
            fail("allgather with a joined rank did not raise")
        except hvd.JoinedRankError as e:
            check("'ag with joined'" in str(e) and "only allreduce and barrier" in str(e), f"message {e}")
        got = hvd.allreduce(np.full(3000, float(r)), name="ar with joined", op=hvd.Sum)
        check(np.allclose(got, sum(range(1, n))), f"allreduce with rank 0 joined: {got[:2]}")
        hvd.join()
    check(np.allclose(hvd.allreduce(np.full(4, float(r)), name="after join 2"), (n - 1) / 2),
          "allreduce after second join")


@section("shutdown and init again")
def _():
    for i in range(2):
        hvd.shutdown()
        check(not hvd.is_initialized(), "is_initialized() after shutdown")
        try:
            hvd.allreduce(np.ones(1))
            fail("allreduce after shutdown did not raise")
        except ValueError as e:
            check("hvd.init()" in str(e), f"message {e}")
        hvd.init()
        check(hvd.rank() == r and hvd.size() == n, "rank/size after re-init")
        check(np.allclose(hvd.allreduce(np.full(5000, float(r)), name="reinit"), (n - 1) / 2), "value after re-init")


@section("fusion threshold 0")
def _():
    hvd.shutdown()
    with_env(HOROVOD_FUSION_THRESHOLD="0")
    hvd.init()
    path = os.path.join(TMP, "nofusion.json")
    hvd.start_timeline(path)
    names = fusion_batch("nofuse", count=16)
    hvd.stop_timeline()
    if r == 0:
        ev = load_timeline(path)
        ars = xevents(ev, "MPI_ALLREDUCE")
        counts = [len(e.get("args", {}).get("tensors", [])) for e in ars]
        check(ars and all(c == 1 for c in counts), f"threshold 0 tensors per call: {counts}")
        for k in range(n):
            mine = {e["args"]["tensors"][0] for e in ars if e["rank"] == k}
            check(set(names) <= mine, f"rank {k}: calls for {len(mine)} tensors, want {len(names)}")
    hvd.shutdown()
    with_env(HOROVOD_FUSION_THRESHOLD=None)


@section("big allreduces cut into chunks")
def _():
    # Big allreduces run as several MPI calls; every rank must cut at the same places,
    # so rank 0's HVD_MAGIC_ALLREDUCE_CHUNK_MB holds even when another rank's differs. A chunk
    # of 104 bytes (26 float32, 13 float64) puts boundaries inside every tensor below.
    hvd.shutdown()
    # (the other settings every rank must share get rank 0's values the same way)
    with_env(HVD_MAGIC_ALLREDUCE_CHUNK_MB="0.0001" if r == 0 else "5",
             HOROVOD_FUSION_THRESHOLD="1048576" if r == 0 else "0",
             HOROVOD_CACHE_CAPACITY="7" if r == 0 else "0")
    hvd.init()
    from hvd_magic.collectives import state
    eng = state.engine()
    check(eng.mpi_backend.chunk == 104, f"chunk {eng.mpi_backend.chunk}")
    check(eng.cfg.fusion_threshold == 1048576, f"fusion threshold {eng.cfg.fusion_threshold}")
    check(eng.codec.cap == 7, f"announcement table size {eng.codec.cap}")
    x = np.arange(1000, dtype=np.float32) + r
    ref = n * np.arange(1000, dtype=np.float32) + n * (n - 1) / 2
    hvd.allreduce_(x, op=hvd.Sum, name="chunk sum_")
    check(np.array_equal(x, ref), "in-place Sum")
    y = np.arange(1001, dtype=np.float64) * (r + 1)
    avg = hvd.allreduce(y, name="chunk avg", postscale_factor=2.0)
    check(np.allclose(avg, 2.0 * np.arange(1001) * (n + 1) / 2), "out-of-place Average, postscale")
    check(np.array_equal(y, np.arange(1001, dtype=np.float64) * (r + 1)), "input kept")
    z = np.full(999, 3 * r + 1, dtype=np.int32)
    hvd.allreduce_(z, name="chunk int avg")
    check(np.array_equal(z, np.full(999, sum(3 * k + 1 for k in range(n)) // n)), "int Average in place")
    m = hvd.allreduce(np.arange(777, dtype=np.float32) * (1 if r % 2 else -1), op=hvd.Max,
                      prescale_factor=0.5, name="chunk max")
    check(np.allclose(m, np.arange(777) * (0.5 if n > 1 else -0.5)), "Max with prescale")
    parts = [np.full(k, float(r + k), dtype=np.float32) for k in (7, 130, 1, 61, 400)]
    outs = hvd.grouped_allreduce(parts, name="chunk group")
    check(all(np.allclose(o, (n - 1) / 2 + k) for o, k in zip(outs, (7, 130, 1, 61, 400))),
          "fused Average")
    big = hvd.allreduce(np.full(1 << 17, float(r), dtype=np.float32), name="chunk big")
    check(np.allclose(big, (n - 1) / 2), "Average of 512 KiB")
    half = hvd.allreduce(np.full(777, r + 0.5, np.float16), name="chunk half", op=hvd.Sum)
    check(half.dtype == np.float16 and np.allclose(half, sum(k + 0.5 for k in range(n))), "float16 Sum")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.full((1000,), float(r))
        hvd.allreduce_(t, op=hvd.Sum, name="chunk torch_")
        check(bool((t == n * (n - 1) / 2).all()), "torch tensor in place")
        o = hvd.allreduce(torch.full((999,), float(r)), name="chunk torch")
        check(torch.is_tensor(o) and bool(torch.allclose(o, torch.full((999,), (n - 1) / 2))),
              "torch tensor out of place")
    # a joined rank contributes zeros to chunked allreduces too (Average divides by every rank)
    if r != n - 1:
        got = hvd.allreduce(np.full(1000, float(r)), name="chunk join")
        check(np.allclose(got, sum(range(n - 1)) / n), f"Average with rank {n - 1} joined: {got[:2]}")
    hvd.join()
    # Submitted together: tensors of a chunk or more are reduced alone, the small ones fused.
    path = os.path.join(TMP, "chunks.json")
    hvd.start_timeline(path)
    sizes = [3, 50, 5, 26, 2, 400, 7]            # 26 float32 = 104 bytes: alone
    ts = [np.full(k, float(r + i), dtype=np.float32) for i, k in enumerate(sizes)]
    hs = [hvd.allreduce_async_(t, name=f"mix{i}") if i % 2 else hvd.allreduce_async(t, name=f"mix{i}")
          for i, t in enumerate(ts)]
    outs = [hvd.synchronize(h) for h in hs]
    hvd.stop_timeline()
    for i, (o, t) in enumerate(zip(outs, ts)):
        check(np.allclose(o, (n - 1) / 2 + i), f"mixed submission {i}")
        check(np.allclose(t, (n - 1) / 2 + i) if i % 2 else np.allclose(t, r + i), f"input {i} after")
    if r == 0:
        calls = [e["args"]["tensors"] for e in xevents(load_timeline(path), "MPI_ALLREDUCE")
                 if e["rank"] == 0]
        for i in (1, 3, 5):
            check([f"mix{i}"] in calls, f"mix{i} not alone in one call: {calls}")
    hvd.shutdown()
    with_env(HVD_MAGIC_ALLREDUCE_CHUNK_MB=None, HOROVOD_FUSION_THRESHOLD=None, HOROVOD_CACHE_CAPACITY=None)


@section("HOROVOD_TIMELINE env")
def _():
    path = os.path.join(TMP, "env_timeline.json")
    with_env(HOROVOD_TIMELINE=path)
    hvd.init()
    with_env(HOROVOD_TIMELINE=None)
    fusion_batch("envtl", count=8)
    hvd.allgather(np.ones((r + 1, 2)), name="envtl.gather")
    hvd.broadcast(np.ones(3), 0, name="envtl.bcast")
    hvd.shutdown()
    if r == 0:
        ev = load_timeline(path)
        phases = {e["name"] for e in xevents(ev)}
        for p in ("NEGOTIATE_ALLREDUCE", "QUEUE", "MPI_ALLREDUCE", "NEGOTIATE_ALLGATHER",
                  "ALLGATHER", "MPI_ALLGATHER", "NEGOTIATE_BROADCAST", "BROADCAST", "MPI_BCAST"):
            check(p in phases, f"phase {p} missing (have {sorted(phases)})")
        ranks = {e["rank"] for e in xevents(ev)}
        check(ranks == set(range(n)), f"rank rows {ranks}")
        for k in range(n):
            kp = {e["name"] for e in xevents(ev) if e["rank"] == k}
            check({"NEGOTIATE_ALLREDUCE", "QUEUE", "MPI_ALLREDUCE"} <= kp, f"rank {k} phases {kp}")
        rows = {e["row"] for e in xevents(ev)}
        check({"allgather.envtl.gather", "broadcast.envtl.bcast"} <= rows, f"rows {sorted(rows)}")
        for e in xevents(ev):
            check(isinstance(e["ts"], (int, float)) and e["dur"] >= 0, f"bad event {e}")
            break


@section("init(comm=mpi4py communicator)")
def _():
    color = WR % 2
    sub = MPI.COMM_WORLD.Split(color, WR)
    hvd.init(comm=sub)
    members = [k for k in range(WN) if k % 2 == color]
    check(hvd.size() == len(members) and hvd.rank() == members.index(WR),
          f"split comm: size {hvd.size()} rank {hvd.rank()}")
    got = hvd.allreduce(np.full(3000, float(WR)), op=hvd.Sum, name="sub")
    check(np.allclose(got, sum(members)), f"split comm allreduce {got[:2]} want {sum(members)}")
    check(hvd.allgather_object(WR) == members, "split comm allgather_object")
    hvd.shutdown()
    hvd.init(comm=MPI.COMM_WORLD)
    check(hvd.size() == WN, "init(comm=COMM_WORLD) size")
    check(np.allclose(hvd.allreduce(np.ones(2), name="world"), 1.0), "COMM_WORLD allreduce")
    hvd.shutdown()
    sub.Free()


if WN == 3:
    @section("init(comm=[0, 2])")
    def _():
        if WR == 1:
            try:
                hvd.init(comm=[0, 2])
                fail("rank 1 init(comm=[0, 2]) did not raise")
            except ValueError as e:
                check("not in the list" in str(e) or "[0, 2]" in str(e), f"message {e}")
            check(not hvd.is_initialized(), "rank 1 initialized after failed init")
        else:
            hvd.init(comm=[0, 2])
            check(hvd.size() == 2 and hvd.rank() == WR // 2, f"size {hvd.size()} rank {hvd.rank()}")
            got = hvd.allreduce(np.full(3, float(WR)), name="pair")
            check(np.allclose(got, 1.0), f"pair allreduce small {got}")
            got = hvd.allreduce(np.full(5000, float(WR)), name="pair big", op=hvd.Sum)
            check(np.allclose(got, 2.0), f"pair allreduce big {got[:2]}")
            check(hvd.local_size() == 2 and hvd.cross_size() == 1, "pair topology")
            hvd.shutdown()
        MPI.COMM_WORLD.Barrier()

    @section("bad init args")
    def _():
        for bad in ([0, 0], [], [5]):
            try:
                hvd.init(comm=bad)
                fail(f"init(comm={bad}) did not raise")
            except ValueError:
                pass


@section("final world")
def _():
    hvd.init()
    check(np.allclose(hvd.allreduce(np.full(2, float(r)), name="final"), (n - 1) / 2), "final allreduce")
    hvd.shutdown()


if FAILS:
    for f in FAILS:
        print(f"rank {WR}: FAIL {f}", file=sys.stderr)
    print(f"rank {WR}: {len(FAILS)} failures", file=sys.stderr)
    sys.exit(1)
print(f"rank {WR}: coll_misc OK")
