"""``%%hvd -np N --ray [ADDRESS]``: the notebook pool with its ranks in Ray actors, on a
Ray the pool starts for itself on this machine, through a real IPython shell
(tests/mpi/ray_pool.py). The same pool on a real two-node Ray cluster is tested in
tests/test_ray.py, which starts that cluster once for both.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import netns_hosts
import ray_cluster

pytest.importorskip("ray", reason="Ray is not installed (make setup installs it)")

HERE = Path(__file__).parent
DRIVER = str(HERE / "mpi" / "ray_pool.py")


@pytest.mark.slow
@pytest.mark.parametrize("netns", ["1", "0"])
def test_a_local_ray_pool_started_and_stopped_with_the_pool(netns):
    """``HVD_MAGIC_NETNS=1``: the Ray runs in a loopback-only namespace where one can be
    made; ``0``: this kernel drives it (as where none can be made), and the start says
    that it listens on this machine's addresses."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HVD_MAGIC_NETNS=netns,
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}")
    proc = subprocess.run([sys.executable, DRIVER, "local"], env=env, capture_output=True,
                          text=True, timeout=300)
    res = ray_cluster.result(proc)
    assert "local Ray, 1 node" in res["start_text"], res["start_text"]
    assert res["first"] == {"0": [0, 2, [3.0] * 3], "1": [1, 2, [3.0] * 3]}
    assert res["second"] == {"0": [0, [4.0] * 3], "1": [1, [4.0] * 3]}
    # the controller opens no TCP port (Unix sockets); Ray and the ranks run in a
    # loopback-only network namespace where one can be made (their ports open there)
    assert not [x for x in res["listen"] if "kernel.controller" in x[2]], res["listen"]
    if res["netns"]:
        assert res["listen"] == [], res["listen"]
    else:
        assert netns == "0" or netns_hosts.unusable_reason()
        assert "listens on this machine's addresses" in res["start_text"], res["start_text"]
    assert res["killed"].startswith("RankDiedError") and \
        "rank 1 died: killed by signal SIGKILL" in res["killed"], \
        (res["killed"], res["killed_timing"])
    # the Ray processes the pool started are gone after %hvd stop
    assert res["stopped_clean"] and res["left"] == [], res["left"]


# A host that answers as ray_host does: a question sent without waiting, asked within
# POLL_S of its last round, is answered at once with nothing; one that may wait is answered
# by a round asked after it arrived, which here finds rank 1 ended.
SCRIPTED_HOST = """
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    if req["cmd"] == "poll":
        exits = {"1": "killed by signal SIGKILL"} if req["wait"] > 0 else {}
        print(json.dumps({"exits": exits}), flush=True)
    elif req["cmd"] == "stop":
        break
"""


def test_a_wait_for_the_actors_report_rests_on_a_question_asked_after_it(tmp_path):
    """The cell's wait loop asks the host without waiting; when the heartbeat then says a
    rank is gone, the pool waits for the actors' report. The reply to the earlier question
    (sent before the rank died, or answered without asking the actors) must not end that
    wait: it once made a killed rank read 'stopped answering the heartbeat'."""
    import time
    from hvd_magic.kernel.notebook.ray_pool import HostedRanks
    ranks = HostedRanks(str(tmp_path), host=[sys.executable, "-c", SCRIPTED_HOST])
    ranks.np = 2
    try:
        assert ranks.poll() == {}            # asked; the answer comes later
        time.sleep(0.3)                      # ... and is waiting when the wait begins
        assert ranks.poll(wait=5.0) == {1: "killed by signal SIGKILL"}
    finally:
        ranks.stop()


@pytest.mark.parametrize("line, address", [("-np 2 --ray", "local"),
                                           ("--ray 10.0.0.1:6379 -np 2", "10.0.0.1:6379"),
                                           ("-np 2 --ray auto", "auto"), ("-np 2", None)])
def test_the_ray_option_takes_an_optional_address(line, address):
    from hvd_magic.magics.args import CELL_USAGE, parse_cell_args
    assert parse_cell_args(line).ray == address
    assert "--ray [ADDRESS]" in CELL_USAGE


def test_ray_goes_without_host_lists():
    from hvd_magic.magics.args import HvdUsageError, parse_cell_args
    with pytest.raises(HvdUsageError, match="not allowed with argument"):
        parse_cell_args("-np 2 --ray -H a:1")


def test_a_ray_profile_gives_the_address(tmp_path):
    from hvd_magic.runner.profiles import ProfileError, describe, launch_of, parse_profile
    prof = parse_profile('scheduler = "ray"\nray_address = "10.0.0.1:6379"\nnp = 4\n')
    assert launch_of(prof).ray == "10.0.0.1:6379" and launch_of(prof).np == 4
    assert launch_of(prof, 2).np == 2 and launch_of(prof).hosts is None
    local = parse_profile('scheduler = "ray"\nnp = 2\n')
    assert launch_of(local).ray == "local"
    assert launch_of(parse_profile('scheduler = "hosts"\nhosts = ["a"]\n')).ray is None
    with pytest.raises(ProfileError, match="ray_address: goes with scheduler"):
        parse_profile('scheduler = "hosts"\nhosts = ["a"]\nray_address = "x:1"\n')
    with pytest.raises(ProfileError, match="hosts: Ray places the ranks"):
        parse_profile('scheduler = "ray"\nhosts = ["a"]\n')
    path = tmp_path / "r.toml"
    path.write_text('scheduler = "ray"\nray_address = "auto"\nnp = 2\n')
    assert "ray auto" in describe([("r", str(path))], str(tmp_path))


def test_hvdrun_refuses_a_ray_profile(tmp_path):
    (tmp_path / "r.toml").write_text('scheduler = "ray"\nnp = 2\n')
    env = dict(os.environ, HVD_MAGIC_PROFILE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "hvd_magic.runner.cli", "--profile", "r",
                           "python", "-c", "1"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "%%hvd --profile" in proc.stderr, proc.stderr
