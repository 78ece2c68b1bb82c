"""Run Horovod's own parallel test files against hvd_magic, with only the import changed.

    .venv/bin/python benchmarks/horovod_suite.py --horovod-src /tmp/hvdsrc \\
        --file test/parallel/test_torch.py --np 2 --json /tmp/horovod_suite_torch.json
    .venv/bin/python benchmarks/horovod_suite.py --horovod-src /tmp/hvdsrc \\
        --file test/parallel/test_mxnet1.py --np 2 --python .venv-mxnet/bin/python
    TF_USE_LEGACY_KERAS=1 .venv/bin/python benchmarks/horovod_suite.py --horovod-src /tmp/hvdsrc \\
        --file test/parallel/test_tensorflow2_keras.py --np 2

(the environment reaches the ranks: with ``TF_USE_LEGACY_KERAS=1`` and tf-keras installed,
``tf.keras`` is Keras 2, as test_tensorflow2_keras.py was written for; 13 of 13 pass at 2 ranks).
Latest (2026-11-25): test_torch.py 100 passed, 12 skipped (10 need a GPU, 2 need Gloo, which
hvd_magic does not offer as a controller), 3 failed (torch 2.13's Muon optimizer in Horovod's
own optimizer list, as with Horovod 0.28.1 itself), no hang, of 115; test_mxnet1.py 57 passed,
5 skipped (GPU) of 62.

The test files are not edited and no Horovod code is copied: they are read from a Horovod
checkout (``--horovod-src``, default ``$HOROVOD_SRC``; ``git archive HEAD test/parallel
test/utils | tar -x`` is enough). "Only the import changed" is done by a shim package
``horovod`` written into a temporary directory and put first on PYTHONPATH (then the test
directory, for ``base_test_*.py``, and ``test/utils``, for Horovod's ``common.py``):

* ``horovod.torch``, ``horovod.tensorflow``, ``horovod.tensorflow.keras``, ``horovod.keras``
  are aliases: a finder at the front of ``sys.meta_path`` puts the hvd_magic face module
  itself in ``sys.modules`` under the Horovod name, so ``import horovod.torch as hvd`` gives
  the very object ``hvd_magic.torch``. No other ``horovod.torch.*`` name exists.
* Names the test files or ``common.py`` import that are not part of the faces, written here
  minimally: ``horovod.common.util.is_version_greater_equal_than`` (packaging's version
  compare), ``horovod.tensorflow.util._executing_eagerly`` (``tf.executing_eagerly()``; as
  for any submodule, Python then also sets ``hvd_magic.tensorflow.util`` for that run),
  ``horovod.runner.util.threads.in_thread`` (starts a thread), and ``mock`` (the PyPI
  backport; here ``unittest.mock``) when it is not installed.

Each test method (listed with ``ast``, the file is not imported) runs in its own launch:
``flock /tmp/mpi.lock timeout T mpiexec -n NP python -m pytest FILE::Class::test -q -p
no:cacheprovider -p horovod_suite_report``. The last plugin (also in the shim dir) writes
each rank's outcome and first error line. A test passes when it passed on every rank; a
launch past ``--timeout`` is a hang (its process group and its ranks are killed).
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
LOCK = "/tmp/mpi.lock"
ALIASES = {"horovod.torch": "hvd_magic.torch", "horovod.tensorflow": "hvd_magic.tensorflow",
           "horovod.tensorflow.keras": "hvd_magic.tensorflow.keras",
           "horovod.keras": "hvd_magic.keras", "horovod.mxnet": "hvd_magic.mxnet",
           "horovod.tensorflow.util": "_horovod_suite_tf_util"}

SHIM = {
    "horovod/__init__.py": f'''
        """Shim: Horovod's module names, answered by hvd_magic's faces (see horovod_suite.py)."""
        import importlib, importlib.abc, importlib.util, sys
        _ALIASES = {ALIASES!r}

        class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                return importlib.util.spec_from_loader(name, self) if name in _ALIASES else None
            def create_module(self, spec):  # a placeholder, replaced by exec_module
                return None
            def exec_module(self, module):  # the import system returns sys.modules[name]
                sys.modules[module.__name__] = importlib.import_module(_ALIASES[module.__name__])

        sys.meta_path.insert(0, _Alias())
        ''',
    "horovod/common/__init__.py": "", "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "", "horovod/runner/common/__init__.py": "",
    "horovod/runner/common/util/__init__.py": "",
    "horovod/runner/common/util/env.py": '''
        import os
        def get_env_rank_and_size():
            for r, s in (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                         ("PMI_RANK", "PMI_SIZE")):
                if r in os.environ and s in os.environ:
                    return int(os.environ[r]), int(os.environ[s])
            return 0, 1
        ''',
    "horovod/common/util.py": '''
        def is_version_greater_equal_than(ver, target):
            from packaging import version
            if not (isinstance(ver, str) and isinstance(target, str)):
                raise ValueError(f"expected two version strings, got {ver!r} and {target!r}")
            return version.parse(ver) >= version.parse(target)
        ''',
    "horovod/runner/util/threads.py": '''
        import threading
        def in_thread(target, args=(), name=None, daemon=True, silent=False):
            thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
            thread.start()
            return thread
        ''',
    "_horovod_suite_tf_util.py": '''
        def _executing_eagerly():
            import tensorflow as tf
            return tf.executing_eagerly()
        ''',
    "horovod_suite_report.py": '''
        """pytest plugin: each rank appends its reports to $HOROVOD_SUITE_OUT/rank<r>.jsonl."""
        import json, os, time
        _RANK = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
        _PATH = os.path.join(os.environ["HOROVOD_SUITE_OUT"], f"rank{_RANK}.jsonl")
        def _write(rec):
            with open(_PATH, "a") as f: f.write(json.dumps(rec) + "\\n")

        def _first_line(report):
            lr = report.longrepr
            if isinstance(lr, tuple):  # skip: (file, line, reason)
                return str(lr[2])
            crash = getattr(lr, "reprcrash", None)
            text = (crash.message if crash is not None else str(lr)).strip()
            return text.splitlines()[0] if text else ""
        def pytest_configure(config):
            _write({"pid": os.getpid()})
        def pytest_runtest_logreport(report):
            line = "" if report.passed else _first_line(report)
            _write({"when": report.when, "outcome": report.outcome, "line": line, "t": time.time()})
        def pytest_collectreport(report):
            if report.failed:
                _write({"when": "collect", "outcome": "failed", "line": _first_line(report),
                        "t": time.time()})
        ''',
}


MOCK_SHIM = "import sys, unittest.mock\nsys.modules[__name__] = unittest.mock\n"


def write_shim(root: Path) -> None:
    for rel, text in SHIM.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    try:
        import mock  # noqa: F401
    except ImportError:
        (root / "mock.py").write_text(MOCK_SHIM)


def shim_env(shim: Path, paths=()) -> dict:
    """This process's environment for a launch: MPI as root on shared memory, one thread per
    rank, and PYTHONPATH with the shim first, then ``paths``, then the caller's."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_btl": "self,sm", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), *map(str, paths),
                                                            os.environ.get("PYTHONPATH")]))})
    return env


def expanded_names(fn: ast.AST) -> list[str]:
    """The names ``@parameterized.expand([...])`` gives a method (``name_0``, ``name_1_<str>``,
    as parameterized 0.9 does), or just its own name."""
    for dec in getattr(fn, "decorator_list", []):
        if isinstance(dec, ast.Call) and ast.unparse(dec.func).endswith("parameterized.expand") \
                and dec.args and isinstance(dec.args[0], (ast.List, ast.Tuple)):
            names = []
            for i, case in enumerate(dec.args[0].elts):
                first = case.elts[0] if isinstance(case, (ast.List, ast.Tuple)) and case.elts else case
                tail = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
                names.append(f"{fn.name}_{i}" + (f"_{re.sub('[^a-zA-Z0-9_]+', '_', tail)}" if tail else ""))
            return names
    return [fn.name]


def _star_imported_classes(path: Path, tree: ast.AST) -> dict:
    """Classes of the sibling modules the file star-imports (``from base_test_mxnet import
    *``), by name: their test methods are inherited by the file's classes."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == "*" for a in node.names):
            sibling = path.with_name(node.module + ".py")
            if sibling.is_file():
                for cls in ast.parse(sibling.read_text(), filename=str(sibling)).body:
                    if isinstance(cls, ast.ClassDef):
                        found[cls.name] = cls
    return found


def _test_methods(cls: ast.ClassDef) -> list:
    return [fn for fn in cls.body if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and fn.name.startswith("test")]


def list_tests(path: Path) -> list[str]:
    """'Class::test_name' for each test method of each class in the file, in file order,
    then those it inherits from a star-imported sibling module's class (base file order)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bases = _star_imported_classes(path, tree)
    out = []
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        own = _test_methods(cls)
        out += [f"{cls.name}::{name}" for fn in own for name in expanded_names(fn)]
        seen = {fn.name for fn in own}
        for base in (bases.get(ast.unparse(b)) for b in cls.bases):
            for fn in _test_methods(base) if base is not None else []:
                if fn.name not in seen:
                    seen.add(fn.name)
                    out += [f"{cls.name}::{name}" for name in expanded_names(fn)]
    return out


def rank_outcome(records: list[dict]) -> tuple[str, str, float]:
    """One rank's (outcome, line, time of its failure) from its pytest reports."""
    for rec in records:
        if rec.get("outcome") == "failed":
            where = f" [in {rec['when']}]" if rec["when"] != "call" else ""
            return "failed", rec["line"] + where, rec.get("t", 0.0)
    for rec in (r for r in records if r.get("outcome") == "skipped"):
        return "skipped", rec["line"], 0.0
    if any(r.get("when") == "call" and r.get("outcome") == "passed" for r in records):
        return "passed", "", 0.0
    return "failed", "", 0.0  # no report: the rank died, or the name was not collected


def decide(ranks: dict, np_: int, rc: int, tail: str) -> tuple[str, str]:
    """The test's (outcome, first error line): of failing ranks, the first to fail is the
    cause (the others often fail because it left, e.g. hvd_magic's ShutdownError)."""
    if rc in (124, 137):
        return "hang", ""
    for r in range(np_):
        if r not in ranks or ranks[r][:2] == ("failed", ""):
            return "failed", f"rank {r} wrote no result (mpiexec exit {rc}): {tail}"
    failed = sorted((t, line) for o, line, t in ranks.values() if o == "failed")
    if failed:
        return "failed", failed[0][1]
    if all(o == "passed" for o, _, _ in ranks.values()):
        return ("passed", "") if rc == 0 else ("failed", f"passed but mpiexec exit {rc}: {tail}")
    return "skipped", next(line for o, line, _ in ranks.values() if o == "skipped")


def run_one(args, test_file: Path, test: str, env: dict, out: Path) -> dict:
    for old in out.glob("rank*.jsonl"):
        old.unlink()
    python = os.path.abspath(args.python) if args.python else sys.executable
    cmd = ["flock", LOCK, "timeout", "--foreground", "-k", "10", str(args.timeout),
           str(Path(python).with_name("mpiexec")) if args.python else MPIEXEC,
           "-n", str(args.np), python, "-m", "pytest", f"{test_file}::{test}", "-q",
           "-p", "no:cacheprovider", "-p", "horovod_suite_report"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=test_file.parent, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate()
    seconds, lines = time.monotonic() - start, [x for x in output.splitlines() if x.strip()]
    ranks, pids = {}, []
    for path in out.glob("rank*.jsonl"):
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        pids += [r["pid"] for r in recs if "pid" in r]
        ranks[int(path.stem[4:])] = rank_outcome([r for r in recs if "pid" not in r])
    # sweep anything left of this launch: its process group, then (after a hang) its ranks
    for kill, pid in [(os.killpg, proc.pid)] + [(os.kill, p) for p in pids
                                                 if proc.returncode in (124, 137)]:
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    outcome, line = decide(ranks, args.np, proc.returncode, lines[-1] if lines else "")
    return {"test": test, "outcome": outcome, "line": line, "rc": proc.returncode,
            "seconds": round(seconds, 1), "ranks": {str(r): list(v) for r, v in ranks.items()},
            "output_tail": output[-3000:] if outcome in ("failed", "hang") else ""}


def summarize(results: list[dict]) -> str:
    counts = collections.Counter(r["outcome"] for r in results)
    text = [" ".join(f"{k}={counts.get(k, 0)}" for k in ("passed", "skipped", "failed", "hang"))
            + f" of {len(results)}"]
    causes = collections.defaultdict(list)
    for r in results:
        if r["outcome"] in ("failed", "hang"):
            causes[r["line"] if r["outcome"] == "failed" else "hang (timeout)"].append(r["test"])
    for cause, tests in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        text += [f"\n[{len(tests)}] {cause}"] + [f"    {t}" for t in tests]
    return "\n".join(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC"),
                   help="Horovod checkout or export holding test/parallel (default $HOROVOD_SRC)")
    p.add_argument("--file", default="test/parallel/test_torch.py")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("-k", dest="k", action="append", default=[],
                   help="run only tests whose name holds this (repeat: any of them)")
    p.add_argument("--timeout", type=int, default=180, help="seconds per test launch")
    p.add_argument("--json", default=None, help="write every test's outcome here")
    p.add_argument("--python", default=None,
                   help="the ranks' python (its venv's mpiexec launches them), e.g. "
                        ".venv-mxnet/bin/python for test_mxnet1.py; default: this one")
    args = p.parse_args(argv)
    if not args.horovod_src:
        p.error("give --horovod-src DIR (or set HOROVOD_SRC): a Horovod checkout with test/parallel")
    src = Path(args.horovod_src).resolve()
    test_file = src / args.file
    if not test_file.is_file():
        p.error(f"{test_file} does not exist; --file is relative to --horovod-src")
    tests = [t for t in list_tests(test_file) if not args.k or any(k in t for k in args.k)]
    with tempfile.TemporaryDirectory(prefix="horovod_suite_") as tmp:
        shim, out = Path(tmp, "shim"), Path(tmp, "out")
        write_shim(shim), out.mkdir()
        if args.python and subprocess.run([args.python, "-c", "import mock"],
                                          capture_output=True).returncode:
            (shim / "mock.py").write_text(MOCK_SHIM)   # the ranks' python lacks it too
        env = shim_env(shim, [test_file.parent, src / "test" / "utils"])
        env["HOROVOD_SUITE_OUT"] = str(out)
        results = []
        for i, test in enumerate(tests, 1):
            res = run_one(args, test_file, test, env, out)
            results.append(res)
            print(f"[{i}/{len(tests)}] {res['outcome']:7} {res['seconds']:6.1f}s {test}"
                  + (f"  -- {res['line']}" if res["line"] and res["outcome"] != "passed" else ""),
                  flush=True)
            if args.json:  # rewritten after each test so a cut-short run keeps what it has
                Path(args.json).write_text(json.dumps({"file": args.file, "np": args.np,
                                                       "tests": results}, indent=1))
    print("\n" + summarize(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
