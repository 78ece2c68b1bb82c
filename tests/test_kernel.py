"""The installed Jupyter kernel "Python (hvd_magic, N ranks)", driven through jupyter_client."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hvd_magic.kernel.__main__ import kernel_spec

psutil = pytest.importorskip("psutil")
pytest.importorskip("jupyter_client")
from test_pool import pool_processes, wait_no_pool_processes  # noqa: E402


def test_kernel_spec():
    spec = kernel_spec(3, python="/x/python")
    assert spec["display_name"] == "Python (hvd_magic, 3 ranks)"
    assert spec["argv"] == ["/x/python", "-m", "hvd_magic.kernel", "launch", "--np", "3",
                            "-f", "{connection_file}"]
    assert spec["interrupt_mode"] == "signal"


def test_install_rejects_a_bad_size(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hvd_magic.kernel", "install", "--np", "0",
                        "--prefix", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and "--np" in p.stderr


def _collect(kc, code, timeout=60):
    outs = []

    def hook(msg):
        if msg["msg_type"] in ("stream", "error", "execute_result"):
            outs.append(msg["content"])
        elif msg["msg_type"] in ("display_data", "update_display_data"):
            # the live panel's final snapshot carries each rank's output as text/plain
            plain = msg["content"].get("data", {}).get("text/plain", "")
            if plain.startswith("["):
                outs.append({"text": plain + "\n"})

    reply = kc.execute_interactive(code, output_hook=hook, timeout=timeout)
    text = "".join(o.get("text", "") for o in outs if "text" in o)
    return reply["content"], text, outs


def _wait_busy(kc, msg_id, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "busy"):
            return
    raise AssertionError("the cell never started")


def test_cells_run_on_every_rank_and_shutdown_leaves_nothing(tmp_path, monkeypatch):
    p = subprocess.run([sys.executable, "-m", "hvd_magic.kernel", "install", "--np", "2",
                        "--prefix", str(tmp_path)], capture_output=True, text=True, check=True)
    assert "Python (hvd_magic, 2 ranks)" in p.stdout
    kdir = tmp_path / "share" / "jupyter" / "kernels" / "hvd_magic_2"
    assert json.loads((kdir / "kernel.json").read_text())["display_name"] == \
        "Python (hvd_magic, 2 ranks)"
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import start_new_kernel
    assert "hvd_magic_2" in KernelSpecManager().find_kernel_specs()
    km, kc = start_new_kernel(kernel_name="hvd_magic_2", startup_timeout=60)
    try:
        content, text, _ = _collect(kc, "import hvd_magic.collectives as hvd\n"
                                        "print('rank', hvd.rank(), 'of', hvd.size())")
        assert content["status"] == "ok", text
        assert "[0] rank 0 of 2" in text and "[1] rank 1 of 2" in text
        # the notebook's interrupt button: SIGINT to the kernel while ranks block
        # (stop_on_error=False: otherwise ipykernel aborts what reaches it in the moment after
        # the error, which the next request can do on a busy machine; a person is slower)
        msg_id = kc.execute("import numpy as np\nif hvd.rank() == 0:\n"
                            "    hvd.allreduce(np.ones(2), name='alone')", stop_on_error=False)
        _wait_busy(kc, msg_id)
        time.sleep(0.5)
        t0 = time.monotonic()
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=10)
        assert reply["parent_header"]["msg_id"] == msg_id
        took = time.monotonic() - t0
        assert reply["content"]["status"] == "error" and took < 3, (reply["content"], took)
        content, text, _ = _collect(kc, "hvd.allreduce(np.ones(1), name='again').tolist()")
        assert content["status"] == "ok" and "[1] Out: [1.0]" in text, (content, text)
        assert pool_processes()
    finally:
        km.shutdown_kernel()
        kc.stop_channels()
    left = wait_no_pool_processes(5.0)
    assert not left, [p.cmdline() for p in left]


def test_restart_and_hard_kill_leave_nothing(tmp_path, monkeypatch):
    subprocess.run([sys.executable, "-m", "hvd_magic.kernel", "install", "--np", "2",
                    "--prefix", str(tmp_path)], capture_output=True, check=True)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="hvd_magic_2", startup_timeout=60)
    try:
        assert _collect(kc, "1")[0]["status"] == "ok"
        assert pool_processes()
        km.restart_kernel(now=False)
        assert not wait_no_pool_processes(5.0)
        kc.wait_for_ready(timeout=60)
        assert _collect(kc, "1")[0]["status"] == "ok"
        assert pool_processes()
        os.kill(km.provisioner.process.pid, 9)   # no atexit: the pool dies with its parent
        assert not wait_no_pool_processes(8.0)
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)
        kc.stop_channels()
