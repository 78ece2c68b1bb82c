"""%hvd export: the pure script builder, and a round trip on the quickstart notebook (its
%%hvd cells through the magics on a real pool, exported, run under hvdrun -np 2: the same
printed lines)."""
from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_magic.runner.export import build_script, carry_value, launcher_command, push_record

ROOT = Path(__file__).resolve().parents[1]


def _cell(line, source, size=2, **kw):
    rec = {"kind": "cell", "line": line, "source": source, "size": size, "ok": True,
           "hosts": None, "hostfile": None, "slurm": None}
    rec.update(kw)
    return rec


def test_script_guards_ranks_adds_init_and_prints_the_last_value(tmp_path):
    made = build_script([_cell("-np 3", "x = 1", 3), _cell("--rank 0", "print('zero')", 3),
                         _cell("--ranks 0,2", "x + 1", 3)], "t.py")
    assert made.np == 3 and made.command == "hvdrun -np 3 python t.py"
    s = made.script
    assert "_hvd.init()" in s
    assert "if _hvd.rank() == 0:\n    print('zero')" in s
    assert "if _hvd.rank() in (0, 2):\n    _hvd_value = (x + 1" in s
    compile(s, "t.py", "exec")


def test_notebook_only_lines_and_failed_cells_are_marked():
    made = build_script([_cell("", "!pip list\n%time y = 2\nprint(3)", ok=False)])
    assert "pass  # notebook only, not run here: !pip list" in made.script
    assert "failed in the notebook" in made.script
    assert len([n for n in made.notes if "notebook-only" in n]) == 2
    compile(made.script, "s.py", "exec")


def test_pushed_values_are_carried_or_said_not_to_be():
    import threading
    rec = push_record(["lr", "arr", "lock"], {"lr": 0.1, "arr": bytearray(b"ab"),
                                              "lock": threading.Lock()}, ranks=[1])
    made = build_script([rec, _cell("", "print(lr)")])
    assert "if _hvd.rank() == 1:\n    lr = 0.1\n    arr = _hvd_unpickle(" in made.script
    assert "NOT CARRIED: lock" in made.script and made.notes
    ns: dict = {}
    exec(made.script.split("import hvd_magic.collectives")[0] + "\n"
         + "def _hvd_unpickle(text):\n    return _hvd_pickle.loads(_hvd_base64.b64decode(text))\n"
         + "arr = " + rec["carried"]["arr"], ns)
    assert ns["arr"] == bytearray(b"ab")
    assert carry_value("x", {"a": [1, 2.5, "s"]}) == ("{'a': [1, 2.5, 's']}", None)


def test_launcher_lines():
    assert launcher_command(4, "a b.py", hosts="h1:2,h2:2") == \
        "hvdrun -np 4 -H h1:2,h2:2 python 'a b.py'"
    line = launcher_command(8, "t.py", slurm={"partition": "gpu", "time": "1:00:00",
                                              "nodes": 2, "gpus_per_node": None})
    assert line.startswith("sbatch --partition=gpu --time=1:00:00 --nodes=2 --ntasks=8 ")
    assert "'--wrap=hvdrun -np 8 python t.py'" in line


def test_a_ray_pool_exports_a_ray_driver():
    """The pool ran on Ray: the script is run with python and drives RayExecutor workers on
    the same cluster (or a Ray of its own, as a local pool had); the cells follow as they
    would under hvdrun (the real run: tests/test_ray.py)."""
    cells = [_cell("-np 2 --ray 10.1.2.3:6379", "w = 1", ray="10.1.2.3:6379"),
             _cell("", "w + 1", ray="10.1.2.3:6379")]
    made = build_script(cells, "t.py")
    assert made.command == "python t.py" and made.np == 2
    assert "ray.init(address='10.1.2.3:6379', log_to_driver=False)" in made.script
    assert "RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)" in made.script
    driver, cells_part = made.script.split("_hvd.init()      # on each worker", 1)
    assert "# cell 2: %%hvd" in cells_part and "# cell" not in driver
    compile(made.script, "t.py", "exec")
    local = build_script([_cell("-np 3 --ray", "x = 1", 3, ray="local")], "t.py").script
    assert 'ray.init(address="local", include_dashboard=False, num_cpus=max(3,' in local


def test_nothing_to_export():
    with pytest.raises(ValueError, match="no %%hvd cell"):
        build_script([{"kind": "push", "names": []}])


# ---------------------------------------------------------------- round trip, real pool

RANK_LINE = re.compile(r"^\[(\d+)\] (?:Out: )?(.*)$")


def _quickstart_cells():
    nb = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and src.startswith("%%hvd") and \
                not src.startswith("%%hvd scale"):
            line, _, body = src.partition("\n")
            # 2 epochs, not 6: the same code path in a third of the suite's time
            yield line[len("%%hvd"):].strip(), body.replace("EPOCHS = 6", "EPOCHS = 2")


@pytest.mark.slow
def test_quickstart_round_trip(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from IPython.testing.globalipapp import get_ipython, start_ipython
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("reload_ext", "hvd_magic")   # fresh magics: no other test's cells
    try:
        capsys.readouterr()
        for line, body in _quickstart_cells():
            res = ip.run_cell(f"%%hvd {line}\n{body}")
            assert res.success, res.error_in_exec
        cells_out = capsys.readouterr().out
        script = tmp_path / "quickstart.py"
        ip.run_line_magic("hvd", f"export {script}")
        said = capsys.readouterr().out
    finally:
        ip.run_line_magic("hvd", "stop")
        ip.run_line_magic("unload_ext", "hvd_magic")
    assert "hvdrun -np 2 python" in said, said
    expected = collections.Counter(m.group(2) for m in map(RANK_LINE.match,
                                                          cells_out.splitlines()) if m)
    assert any(k.startswith("epoch 1: loss") for k in expected), cells_out
    proc = subprocess.run([sys.executable, "-m", "hvd_magic.runner.cli", "-np", "2",
                           "python", str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = collections.Counter(ln for ln in proc.stdout.splitlines() if ln.strip())
    assert got == expected, (got, expected, script.read_text())


@pytest.mark.slow
def test_three_rank_round_trip_with_push_and_rank_guards(tmp_path, capsys):
    from IPython.testing.globalipapp import get_ipython, start_ipython
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("reload_ext", "hvd_magic")   # fresh magics: no other test's cells
    cells = [("-np 3 --no-stream", "import numpy as np\nimport hvd_magic.collectives as hvd\n"
                                   "print('size', hvd.size())"),
             ("--no-stream", "s = hvd.allreduce(np.array([lr * (hvd.rank() + 1)]), op=hvd.Sum)\n"
                             "print('sum', float(s[0]), cfg['name'])"),
             ("--rank 2", "print('only rank', hvd.rank())"),
             ("--ranks 0,1", "hvd.rank() * 10")]
    try:
        capsys.readouterr()
        ip.user_ns.update(lr=0.5, cfg={"name": "x", "arr": np_array()})
        for i, (line, body) in enumerate(cells):
            if i == 1:
                ip.run_line_magic("hvd", "push lr cfg")
            res = ip.run_cell(f"%%hvd {line}\n{body}")
            assert res.success, res.error_in_exec
        cells_out = capsys.readouterr().out
        script = tmp_path / "three.py"
        ip.run_line_magic("hvd", f"export {script}")
        said = capsys.readouterr().out
    finally:
        ip.run_line_magic("hvd", "stop")
        ip.run_line_magic("unload_ext", "hvd_magic")
    assert "hvdrun -np 3 python" in said, said
    text = script.read_text()
    assert "lr = 0.5" in text and "cfg = _hvd_unpickle(" in text
    expected = collections.Counter(m.group(2) for m in map(RANK_LINE.match,
                                                          cells_out.splitlines()) if m)
    assert expected["sum 3.0 x"] == 3 and expected["only rank 2"] == 1, cells_out
    assert expected["0"] == 1 and expected["10"] == 1, cells_out
    proc = subprocess.run([sys.executable, "-m", "hvd_magic.runner.cli", "-np", "3",
                           "python", str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = collections.Counter(ln for ln in proc.stdout.splitlines() if ln.strip())
    assert got == expected, (got, expected, text)


def np_array():
    import numpy as np
    return np.arange(3.0)
