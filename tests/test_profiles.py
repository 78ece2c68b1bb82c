"""Cluster profiles (hvd_magic/runner/profiles.py): parsing, errors that name the key and
its line, what a profile means for a launch, listing; and the options that use them
(hvdrun --profile / --profiles, %%hvd --profile, %hvd profiles)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hvd_magic.magics.args import HvdUsageError, parse_cell_args, parse_line_args
from hvd_magic.runner.plan import Host
from hvd_magic.runner.profiles import ProfileError, describe, find_profiles, launch_of, \
    load_profile, parse_profile, profile_dir, setup_steps

SLURM = """\
description = "GPU partition"
scheduler = "slurm"
processes_per_host = 4
network_interface = "ib0"
modules = ["cuda/12.4", "openmpi/5.0"]
setup = ["pip install -q -r requirements.txt", "python prep.py"]

[slurm]
partition = "gpu"
time = "2:00:00"
nodes = 2
gpus_per_node = 4

[env]
NCCL_DEBUG = "WARN"
SEED = 7
"""

HOSTS = """\
scheduler = "hosts"
hosts = ["node1", "node2:2"]
slots_per_host = 4
"""


def test_a_slurm_profile_parses_and_means_an_allocation():
    prof = parse_profile(SLURM, "gpu", "/p/gpu.toml")
    assert prof.scheduler == "slurm" and prof.description == "GPU partition"
    assert prof.slurm == {"partition": "gpu", "time": "2:00:00", "nodes": 2,
                          "gpus_per_node": 4}
    assert prof.env == {"NCCL_DEBUG": "WARN", "SEED": "7"}
    plan = launch_of(prof)
    assert plan.np == 8                                   # 4 per node x 2 nodes
    assert plan.hosts is None
    assert plan.slurm == {"partition": "gpu", "time": "2:00:00", "nodes": 2,
                          "gpus_per_node": 4}
    assert plan.env["NCCL_SOCKET_IFNAME"] == "ib0" and plan.env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert plan.env["PRTE_MCA_prte_if_include"] == "ib0"
    assert plan.env["NCCL_DEBUG"] == "WARN"
    assert plan.setup == ["module load cuda/12.4 openmpi/5.0 && pip install -q -r "
                          "requirements.txt", "module load cuda/12.4 openmpi/5.0 && python "
                          "prep.py"]
    assert launch_of(prof, np=3).np == 3                  # -np wins


def test_a_host_profile_gives_hosts_and_slots():
    prof = parse_profile(HOSTS, "lab")
    assert prof.hosts == [Host("node1", 4), Host("node2", 2)]
    plan = launch_of(prof)
    assert plan.np == 6 and plan.slurm is None and plan.hosts == prof.hosts
    assert plan.setup == []
    per = parse_profile(HOSTS + "processes_per_host = 1\n", "lab")
    assert launch_of(per).np == 2 and launch_of(per).hosts == [Host("node1", 1),
                                                               Host("node2", 1)]
    # a subnet is for Open MPI only: NCCL/Gloo get no interface name from it
    net = launch_of(parse_profile(HOSTS + 'network_interface = "10.0.0.0/24"\n'))
    assert "NCCL_SOCKET_IFNAME" not in net.env
    assert net.env["OMPI_MCA_btl_tcp_if_include"] == "10.0.0.0/24"


@pytest.mark.parametrize("text, where, words", [
    ('scheduler = "slurm"\nnodes = 2\n', ":2: nodes", "unknown key"),
    ('scheduler = "pbs"\n', ":1: scheduler", "use \"slurm\" or \"hosts\""),
    ('description = "x"\n', "p.toml: scheduler", "missing"),
    ('scheduler = "slurm"\n\n[slurm]\npartition = "gpu"\nnodes = "two"\n', ":5: slurm.nodes",
     "must be a whole number"),
    ('scheduler = "slurm"\n[slurm]\ntime = "soon"\n', ":3: slurm.time", "Slurm's formats"),
    ('scheduler = "slurm"\n[slurm]\ngpus = 2\n', ":3: slurm.gpus", "unknown key"),
    ('scheduler = "hosts"\nhosts = ["a", "a"]\n', ":2: hosts", "listed twice"),
    ('scheduler = "hosts"\nhosts = ["a:x"]\n', ":2: hosts", "slots"),
    ('scheduler = "hosts"\n', ":1: scheduler", "needs hosts"),
    ('scheduler = "slurm"\nhosts = ["a"]\n', ":2: hosts", "scheduler = \"hosts\""),
    ('scheduler = "slurm"\nprocesses_per_host = 0\n', ":2: processes_per_host", "at least 1"),
    ('scheduler = "slurm"\nsetup = ["ok", ""]\n', ":2: setup", "non-empty"),
    ('scheduler = "slurm"\nmodules = ["cuda; rm -rf /"]\n', ":2: modules", "module name"),
    ('scheduler = "slurm"\n[env]\n"1BAD" = "x"\n', ":3: env.1BAD", "variable name"),
    ('scheduler = "slurm"\n[env]\nX = [1]\n', ":3: env.X", "string or number"),
    ('scheduler = "slurm"\nprocesses_per_host = true\n', ":2: processes_per_host",
     "whole number"),
    ('scheduler = "slurm"\nx = \n', "not valid TOML", "line 2"),
])
def test_bad_profiles_name_the_key_and_the_line(text, where, words):
    with pytest.raises(ProfileError) as info:
        parse_profile(text, "p", "p.toml")
    msg = str(info.value)
    assert where in msg and words in msg, msg
    assert msg.startswith("p.toml")


def test_a_slurm_profile_without_a_size_asks_for_np():
    prof = parse_profile('scheduler = "slurm"\n', "s", "s.toml")
    with pytest.raises(ProfileError, match="-np"):
        launch_of(prof)
    assert launch_of(prof, np=4).np == 4


def test_setup_without_modules_is_the_lines_as_written():
    prof = parse_profile('scheduler = "slurm"\nsetup = ["echo hi"]\n')
    assert setup_steps(prof) == ["echo hi"]


def test_the_profile_directory_lookup_and_listing(tmp_path):
    env = {"HVD_MAGIC_PROFILE_DIR": str(tmp_path), "HOME": "/nowhere"}
    assert profile_dir(env) == str(tmp_path)
    assert profile_dir({"HOME": "/h"}) == "/h/.hvd_magic/profiles"
    assert "no cluster profiles" in describe(find_profiles(str(tmp_path)), str(tmp_path))
    (tmp_path / "gpu.toml").write_text(SLURM)
    (tmp_path / "lab.toml").write_text(HOSTS)
    (tmp_path / "bad.toml").write_text('scheduler = "pbs"\n')
    (tmp_path / "notes.txt").write_text("not a profile")
    assert [n for n, _ in find_profiles(str(tmp_path))] == ["bad", "gpu", "lab"]
    text = describe(find_profiles(str(tmp_path)), str(tmp_path))
    assert "gpu" in text and "slurm partition=gpu" in text and "2 setup line(s)" in text
    assert "hosts node1:4,node2:2" in text
    assert "bad" in text and "unusable" in text and "bad.toml:1: scheduler" in text
    assert load_profile("lab", env).hosts[0] == Host("node1", 4)
    with pytest.raises(ProfileError, match="profiles there: bad, gpu, lab"):
        load_profile("nope", env)
    with pytest.raises(ProfileError, match="profile name"):
        load_profile("../etc/passwd", env)


def test_magic_arguments_for_slurm_and_profiles():
    req = parse_cell_args("-np 8 --slurm --partition gpu --time 1:00:00 --nodes 2 "
                          "--gpus-per-node 4")
    assert req.slurm == {"partition": "gpu", "time": "1:00:00", "nodes": 2,
                         "gpus_per_node": 4}
    assert parse_cell_args("--slurm").slurm == {"partition": None, "time": None,
                                               "nodes": None, "gpus_per_node": None}
    assert parse_cell_args("--profile gpu").profile == "gpu"
    for bad, words in (("--partition gpu", "goes with --slurm"),
                       ("--slurm --nodes 0", "whole number"),
                       ("-np 2 --slurm --nodes 3", "more nodes than ranks"),
                       ("--slurm --time soon", "Slurm's formats"),
                       ("--slurm -H a:1", "not allowed with"),
                       ("--slurm --profile x", "not allowed with"),
                       ("--profile a/b", "profile's name")):
        with pytest.raises(HvdUsageError, match=words):
            parse_cell_args(bad)
    assert parse_line_args("profiles").command == "profiles"
    assert parse_line_args("start -np 4 --slurm --nodes 2").pool.slurm["nodes"] == 2


def test_hvdrun_lists_profiles_and_refuses_a_bad_one(tmp_path):
    (tmp_path / "lab.toml").write_text(HOSTS)
    (tmp_path / "bad.toml").write_text('scheduler = "hosts"\nhosts = ["a", "a"]\n')
    env = {"HVD_MAGIC_PROFILE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "hvd_magic.runner.cli", "--profiles"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "lab" in out.stdout and "node1:4" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "hvd_magic.runner.cli", "--profile", "bad",
                          "python", "-c", "1"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "bad.toml:2: hosts" in bad.stderr, bad.stderr


def test_setup_lines_run_in_order_and_a_failing_line_stops_the_start(tmp_path):
    """On a host list the lines run through mpiexec, one process per host (here the one
    local host); a line that fails says which line and shows its output."""
    from hvd_magic.runner.setup_lines import run_setup
    seen = []
    run_setup([f"echo one > {tmp_path}/a", f"cat {tmp_path}/a > {tmp_path}/b"],
              hosts=[Host("localhost", 4)], status=seen.append)
    assert (tmp_path / "b").read_text() == "one\n"
    assert seen[0].startswith("hvd: setup 1/2 on every host: echo one")
    with pytest.raises(ValueError) as info:
        run_setup(["echo fine", "echo broken-line >&2; exit 3", f"touch {tmp_path}/never"],
                  hosts=None)
    msg = str(info.value)
    assert "setup line 2" in msg and "exit" in msg and "broken-line" in msg, msg
    assert not (tmp_path / "never").exists()
