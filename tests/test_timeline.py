"""The Horovod timeline (HOROVOD_TIMELINE, hvd.start_timeline) as a user reads it: written
while the job runs, readable (tail) during the run, and still a loadable Chrome trace after
the whole job is killed with SIGKILL, in Horovod's layout and names."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from mpi_harness import HERE, MPIEXEC, mpi_env, start_job

from hvd_magic.collectives.timeline import NEGOTIATE, QUEUE, TimelineWriter


def read_trace(path, running: bool = False) -> list:
    """The records of a timeline file, checked the way a trace viewer reads it: a JSON array
    whose closing ``]`` may be missing (Chrome's JSON Array format allows that), and in which
    every line after the ``[`` is one whole record (a killed writer left no partial one).
    ``running``: the file is read while the job writes it, so its last line may be a record
    whose write is still under way: it is left out, as a program that tails the file would."""
    with open(path, encoding="utf-8", errors="replace" if running else "strict") as f:
        text = f.read()
    assert text.startswith("[\n"), text[:80]
    if running and "\n" in text[2:]:
        head, last = text.rsplit("\n", 1)
        try:
            json.loads(last.rstrip(","))
        except ValueError:
            text = head
        text = text.rstrip().rstrip(",")       # (a cut between a record and the next)
    body = text.rstrip()
    closed = body.endswith("]")
    records = json.loads(body if closed else body + "]")
    lines = [ln for ln in text.splitlines()[1:] if ln.strip() not in ("", "]")]
    for ln in lines:
        rec = json.loads(ln[:-1] if ln.endswith(",") else ln)       # one whole record a line
        assert isinstance(rec, dict), ln
    assert len(lines) == len(records), (len(lines), len(records))
    return records


def check_nesting(records: list) -> None:
    """Every "E" ends the latest open "B" of its row (pid, tid), as trace viewers pair them."""
    stacks: dict = {}
    for rec in records:
        key = (rec.get("pid"), rec.get("tid"))
        if rec["ph"] == "B":
            stacks.setdefault(key, []).append(rec)
        elif rec["ph"] == "E":
            assert stacks.get(key), f"E without B in row {key}: {rec}"
            begin = stacks[key].pop()
            assert rec["ts"] >= begin["ts"], (begin, rec)


def epoch_start_us(records: list) -> int:
    meta = [r for r in records if r.get("ph") == "M" and r.get("pid") == 0
            and r.get("name") == "process_name"]
    assert meta, records[:3]
    return meta[0]["args"]["start_time_since_epoch_in_micros"]


def session_pids(sid: int) -> list:
    """Processes of session ``sid`` (the launcher and every rank: Open MPI puts each rank in
    a process group of its own, so killing the launcher's group alone would miss them)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # (the fields after the name: state ppid pgrp session; a killed rank may stay a
            # zombie until its new parent reaps it)
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(name))
    return out


def kill_session(sid: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("mode", ["env", "dynamic"])
def test_timeline_is_readable_while_running_and_after_sigkill(mode, tmp_path):
    path = tmp_path / "timeline.json"
    extra = {"HOROVOD_TIMELINE": str(path)} if mode == "env" else {}
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(HERE / "mpi" / "timeline_kill.py"), mode, str(path)]
    proc = start_job(cmd, mpi_env(extra))
    try:
        # While the job runs: the file is there, non-empty and a loadable trace holding
        # both ranks' allreduces (read twice: it grows as the loop goes on).
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and path.stat().st_size > 0:
                recs = read_trace(path, running=True)
                ranks = {r.get("tid") for r in recs if r.get("name") == "MPI_ALLREDUCE"}
                if ranks >= {0, 1}:
                    seen.append(len(recs))
                    if len(seen) == 2:
                        break
                    time.sleep(1.0)
                    continue
            time.sleep(0.2)
        assert proc.poll() is None, f"the job ended early:\n{proc.communicate()[1]}"
        assert len(seen) == 2 and seen[1] > seen[0], \
            f"timeline not written while the job runs (records seen: {seen})"
        time.sleep(1.5)
        killed_at = time.time()
        kill_session(proc.pid)
        proc.communicate(timeout=30)
    finally:
        kill_session(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not session_pids(proc.pid), "ranks survived the kill"

    recs = read_trace(path)            # (the writer never got to close the file)
    check_nesting(recs)
    start = epoch_start_us(recs)
    timed = [r for r in recs if r["ph"] in ("B", "E", "X", "i")]
    last = start + max(r["ts"] for r in timed)
    assert killed_at - last / 1e6 < 2.5, \
        f"the last event is {killed_at - last / 1e6:.2f} s older than the kill"

    # Horovod's layout: one process row per tensor, named as Horovod's torch names them
    rows = {r["args"]["name"]: r["pid"] for r in recs
            if r["ph"] == "M" and r["name"] == "process_name" and r["pid"] != 0}
    assert {f"allreduce.grad.{i}" for i in range(4)} | {"allreduce.loss"} <= set(rows), rows
    # ... one thread row per rank in each
    threads = {(r["pid"], r["args"]["name"]) for r in recs if r["ph"] == "M" and r["name"] == "thread_name"}
    assert {(rows["allreduce.loss"], "rank 0"), (rows["allreduce.loss"], "rank 1")} <= threads, threads
    begins = {r["name"] for r in recs if r["ph"] == "B"}
    for name in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "MPI_ALLREDUCE",
                 "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"):
        assert name in begins, f"{name} missing: {sorted(begins)}"
    ticks = {(r["pid"], r["name"]) for r in recs if r["ph"] == "X" and r["dur"] == 0}
    assert {(rows["allreduce.loss"], "0"), (rows["allreduce.loss"], "1")} <= ticks
    cycles = [r for r in recs if r.get("name") == "CYCLE_START"]
    if mode == "dynamic":            # start_timeline(..., mark_cycles=True)
        assert cycles and all(r["ph"] == "i" and r["s"] == "g" for r in cycles), cycles[:3]
    else:
        assert not cycles


def test_a_hung_job_has_every_ranks_last_steps_in_the_file(tmp_path):
    """The last rank stops after 10 steps (stuck in its own code) while rank 0 waits for it:
    within a few seconds the file holds both ranks' last step, though no rank has anything
    to negotiate any more (the idle ranks still bring their events to rank 0)."""
    path = tmp_path / "timeline.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(HERE / "mpi" / "timeline_kill.py"), "hang", str(path)]
    proc = start_job(cmd, mpi_env({"HOROVOD_TIMELINE": str(path)}))

    def last_step_rows():
        if not path.exists():
            return set()
        recs = read_trace(path, running=True)
        rows = {r["pid"] for r in recs if r["ph"] == "M" and r["name"] == "process_name"
                and r["args"].get("name") == "allreduce.step.9"}
        return {r["tid"] for r in recs if r.get("pid") in rows and r.get("name") == "MPI_ALLREDUCE"}

    try:
        deadline = time.monotonic() + 120
        while 0 not in last_step_rows() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, f"the job ended early:\n{proc.communicate()[1]}"
        assert 0 in last_step_rows(), "rank 0's last step never reached the file"
        deadline = time.monotonic() + 4          # (the stall check's idle heartbeat is 15 s)
        while last_step_rows() != {0, 1} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert last_step_rows() == {0, 1}, f"the last step's rows: ranks {last_step_rows()}"
    finally:
        kill_session(proc.pid)
        proc.communicate(timeout=30)


def test_writer_streams_whole_records_and_closes_valid(tmp_path):
    """The writer alone: events show up in the file within its flush period, not at close;
    after close the file is a complete JSON array."""
    path = tmp_path / "t.json"
    w = TimelineWriter(str(path))
    try:
        t0 = time.time() * 1e6
        w.write([(0, "w", NEGOTIATE, t0, 10.0, {"request": "ALLREDUCE"}),
                 (0, "w", QUEUE, t0 + 10, 2.0, None),
                 (0, "w", "MPI_ALLREDUCE", t0 + 12, 5.0, {"bytes": 8})])
        deadline = time.monotonic() + 10
        recs = read_trace(path, running=True)
        while not any(r.get("name") == "MPI_ALLREDUCE" for r in recs) and time.monotonic() < deadline:
            time.sleep(0.05)
            recs = read_trace(path, running=True)
        assert any(r.get("name") == "MPI_ALLREDUCE" for r in recs), recs
    finally:
        w.close()
    with open(path, encoding="utf-8") as f:
        recs = json.load(f)
    check_nesting(recs)
    seq = [(r["ph"], r.get("name")) for r in recs if r["ph"] in ("B", "E", "X")]
    assert seq == [("B", "NEGOTIATE_ALLREDUCE"), ("X", "0"), ("E", None), ("B", "ALLREDUCE"),
                   ("B", "QUEUE"), ("E", None), ("B", "MPI_ALLREDUCE"), ("E", None), ("E", None)], seq
