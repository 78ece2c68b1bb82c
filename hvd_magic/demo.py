"""``python -m hvd_magic.demo`` (``make demo``): run the quickstart notebook at 2 ranks in a
real Jupyter kernel, top to bottom, and print what each cell showed.

The notebook is ``notebooks/quickstart.ipynb``; the executed copy and its HTML go to
``build/demo/`` (open the notebook in JupyterLab to see the live panels' saved snapshots).
Ends with the test accuracy, the 2-rank scaling efficiency and those two paths. Without a
notebook toolchain it falls back to :mod:`hvd_magic.demo_script`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
OUT_DIR = ROOT / "build" / "demo"


def _text_of(output: dict) -> str:
    if output.get("output_type") == "stream":
        return output.get("text", "")
    data = output.get("data", {})
    if "application/vnd.jupyter.widget-view+json" in data:
        return ""          # the live panel; its final text snapshot follows as its own output
    return str(data.get("text/plain", ""))


def main() -> int:
    try:
        import nbclient
        import nbformat
    except ImportError:
        print("nbclient/nbformat are not installed (make setup installs them); running the "
              "script demo instead")
        from .demo_script import main as script_main
        return script_main()
    if not NOTEBOOK.exists():
        print(f"{NOTEBOOK} is missing", file=sys.stderr)
        return 1
    nb = nbformat.read(NOTEBOOK, as_version=4)
    print(f"hvd_magic demo: running {NOTEBOOK.name} (2 MPI ranks) in a Jupyter kernel ...", flush=True)
    t0 = time.monotonic()
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    except nbclient.exceptions.CellExecutionError as exc:
        print(f"a cell failed:\n{exc}", file=sys.stderr)
        return 1
    summary = ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            title = next((ln for ln in cell.source.splitlines() if ln.startswith("#")), "")
            if title:
                print(f"\n{title.lstrip('# ')}")
            continue
        src = cell.source.strip().splitlines()
        print(f"\n>>> {src[0] if src else ''}{' ...' if len(src) > 1 else ''}")
        for out in cell.get("outputs", []):
            text = _text_of(out).rstrip()
            if text:
                print("    " + text.replace("\n", "\n    "))
            summary = next((ln for ln in text.splitlines() if ln.startswith("quickstart:")),
                           summary)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out_path = OUT_DIR / NOTEBOOK.name
    nbformat.write(nb, out_path)
    html_path = out_path.with_suffix(".html")
    try:
        from nbconvert import HTMLExporter
        html_path.write_text(HTMLExporter().from_notebook_node(nb)[0], encoding="utf-8")
    except ImportError:
        html_path = None
    print(f"\n{summary or 'quickstart: (no summary line: see the outputs above)'}")
    print(f"ran in {time.monotonic() - t0:.1f} s\nexecuted notebook: {out_path}")
    print(f"HTML: {html_path}" if html_path else "HTML: not written (nbconvert is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
