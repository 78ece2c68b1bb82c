"""The widgets in a real browser: JupyterLab + headless chromium (playwright), a notebook
that loads the extension and trains on 2 ranks with %%hvd. Screenshots go to artifacts/."""
from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "browser"))
import lab  # noqa: E402

ARTIFACTS = HERE.parent / "artifacts"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(lab.missing() is not None, reason=str(lab.missing()))]

# Read the timeline from the page: bokeh documents -> the ColumnDataSource with a "rank"
# column -> number of spans per rank (compute and collective).
SPANS_JS = """() => {
  const out = {};
  if (!window.Bokeh || !window.Bokeh.documents) return out;
  for (const doc of window.Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.type !== 'ColumnDataSource' && !(m.data && m.data.get)) continue;
      const d = m.data; const get = (k) => d.get ? d.get(k) : d[k];
      const ranks = get('rank'), phases = get('phase'), right = get('right');
      if (!ranks || !phases) continue;
      for (let i = 0; i < ranks.length; i++) {
        out['end' + ranks[i]] = Math.max(out['end' + ranks[i]] || 0, right[i]);
        const key = ranks[i] + ':' + (phases[i] === 'COMPUTE' ? 'compute' : 'collective');
        out[key] = (out[key] || 0) + 1;
      }
    }
  }
  return out;
}"""


# The elastic resets drawn on the timeline: the source with a "label" column and no "rank".
RESETS_JS = """() => {
  const out = [];
  if (!window.Bokeh || !window.Bokeh.documents) return out;
  for (const doc of window.Bokeh.documents) {
    for (const m of doc.all_models) {
      if (!m.data) continue;
      const get = (k) => m.data.get ? m.data.get(k) : m.data[k];
      const label = get('label'), left = get('left'), right = get('right');
      if (!label || get('rank') || !left) continue;
      for (let i = 0; i < label.length; i++) out.push([left[i], right[i], label[i]]);
    }
  }
  return out;
}"""


def lane_text(page, rank):
    loc = page.locator(f"pre.hvdm-log[data-rank='{rank}']")
    return loc.first.inner_text() if loc.count() else ""


def test_live_panel_in_jupyterlab(tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    root = tmp_path / "nb"
    root.mkdir()
    shutil.copy(HERE / "browser" / "live.ipynb", root / "live.ipynb")
    with lab.jupyter_lab(root, ARTIFACTS / "jupyterlab.log") as base, \
            lab.browser(tmp_path / "profile") as ctx:
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        lab.open_notebook(page, base, "live.ipynb")
        lab.run_all(page)
        t0 = time.time()
        # while the training cell runs: both lanes stream, the timeline has both ranks
        live = None
        while time.time() - t0 < 60:
            spans = page.evaluate(SPANS_JS)
            l0, l1 = lane_text(page, 0), lane_text(page, 1)
            running = page.locator(".jp-InputPrompt:has-text('[*]')").count() > 0
            if running and "loss" in l0 and "loss" in l1 and \
                    spans.get("0:collective", 0) > 5 and spans.get("1:collective", 0) > 5 and \
                    spans.get("0:compute", 0) > 5:
                live = (time.time() - t0, spans)
                break
            time.sleep(0.5)
        page.screenshot(path=str(ARTIFACTS / "widgets-live.png"), full_page=True)
        assert live is not None, f"no live spans/logs for both ranks; spans={spans} " \
                                 f"lanes={l0[-200:]!r} / {l1[-200:]!r} errors={errors}"
        spans_then = live[1]
        # predicted beside measured: the efficiency the what-if model predicts for this pool
        # (one host, no %hvd doctor: its defaults) next to the measured one, live
        t1, pred = time.time(), ""
        while time.time() - t1 < 20 and not pred:
            loc = page.locator(".hvdm-metrics").first.locator(".hvdm-predicted")
            pred = loc.first.inner_text() if loc.count() else ""
            time.sleep(0.3)
        running = page.locator(".jp-InputPrompt:has-text('[*]')").count() > 0
        assert re.search(r"efficiency: measured \d+%.*predicted \d+%", pred), pred
        assert "no doctor measurement: defaults" in pred and running, pred
        badges = page.locator(".hvdm-badge").all_inner_texts()
        assert any("rank 0: running" in b for b in badges), badges
        # the timeline keeps growing while the cell runs (a batch a second, each drawn)
        time.sleep(2.0)
        spans_later = page.evaluate(SPANS_JS)
        assert spans_later["end0"] > spans_then["end0"] + 0.3, (spans_then, spans_later)
        assert spans_later["end1"] > spans_then["end1"] + 0.3, (spans_then, spans_later)
        # efficiency readout has numbers
        metrics = page.locator(".hvdm-metrics").first.inner_text()
        assert re.search(r"communication\s+\d+%", metrics), metrics
        assert re.search(r"throughput\s+[\d.]+\s*k?", metrics), metrics
        # the filter shows one rank
        # the filter (tabs, switched in the browser while the kernel is busy) shows one rank
        page.locator(".hvdm-panel .lm-TabBar-tab:has-text('rank 1')").first.click()
        time.sleep(0.3)
        visible = lambda sel: sum(1 for e in page.locator(sel).all() if e.is_visible())  # noqa: E731
        assert visible(".hvdm-lane-0") == 0 and visible(".hvdm-lane-1") == 1
        page.screenshot(path=str(ARTIFACTS / "widgets-filter.png"), full_page=True)
        page.locator(".hvdm-panel .lm-TabBar-tab:has-text('all ranks')").first.click()
        time.sleep(0.3)
        assert visible(".hvdm-lane-0") == 1 and visible(".hvdm-lane-1") == 1
        # end of the cell: done badges, snapshot, final numbers
        try:
            page.locator(".hvdm-panel .hvdm-badge:has-text('rank 1: done')").first.wait_for(
                timeout=40000)
        finally:
            page.screenshot(path=str(ARTIFACTS / "widgets-done.png"), full_page=True)
        page.locator("details.hvdm-snapshot").first.wait_for(state="attached", timeout=10000)
        assert "finished" in lane_text(page, 0) and "finished" in lane_text(page, 1)
        assert "stderr" in page.locator("pre.hvdm-log[data-rank='0']").first.inner_html()
        final = page.locator(".hvdm-metrics").first.inner_text()
        assert re.search(r"communication\s+\d+%", final), final
        assert re.search(r"efficiency: measured \d+%.*predicted \d+%", final), final
        page.screenshot(path=str(ARTIFACTS / "widgets-done.png"), full_page=True)
        # the elastic cell (3 ranks, --min-np 2): rank 2 is killed mid-training. While the cell
        # still runs, its panel marks rank 2 lost, draws the reset across the timeline and
        # counts throughput again on the 2 ranks left
        panel = page.locator(".hvdm-panel").nth(1)
        try:
            panel.locator(".hvdm-badge:has-text('rank 2: lost')").first.wait_for(timeout=90000)
            running = page.locator(".jp-InputPrompt:has-text('[*]')").count() > 0
            panel.scroll_into_view_if_needed()
            t0 = time.time()
            resets = []
            while time.time() - t0 < 10 and not resets:
                resets = page.evaluate(RESETS_JS)
                time.sleep(0.3)
            page.screenshot(path=str(ARTIFACTS / "widgets-elastic.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "widgets-elastic.png"), full_page=True)
            raise
        assert running, "the lost rank was shown only after the cell ended"
        assert len(resets) == 1 and "rank 2 lost; 2 ranks went on from commit" in resets[0][2], \
            resets
        assert 0 < resets[0][0] <= resets[0][1], resets
        metrics = panel.locator(".hvdm-metrics").first.inner_text()
        assert "since the last reset" in metrics and "elastic reset at" in metrics, metrics
        # the cell's end, as a user waits for it: both survivors done and the cell's snapshot
        # written (rank 1 can finish before rank 0 prints its last line); then rank 0's last
        # line is in its lane, within the panel's next redraw
        for r in (0, 1):
            panel.locator(f".hvdm-badge:has-text('rank {r}: done')").first.wait_for(timeout=60000)
        page.locator("details.hvdm-snapshot").nth(1).wait_for(state="attached", timeout=30000)
        t0 = time.time()
        lane = ""
        while "rank 0 of 2: step 600" not in lane and time.time() - t0 < 10:
            lane = panel.locator("pre.hvdm-log[data-rank='0']").first.inner_text()
            time.sleep(0.2)
        assert "rank 0 of 2: step 600" in lane, lane
        page.screenshot(path=str(ARTIFACTS / "widgets-elastic.png"), full_page=True)
        assert not [e for e in errors if "bokeh" in e.lower()], errors


PREDICTED_CELLS = ["%load_ext hvd_magic", "%hvd doctor -np 2", """%%hvd -np 2 POOL
import time, torch
import hvd_magic.torch as hvd
from hvd_magic import report
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
x, y = torch.randn(32, 256), torch.randn(32, 256)
for step in range(1500):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    time.sleep(0.004)          # stands in for the rest of a step
    report(samples=32)
    if step % 300 == 0:
        print(f"step {step} rank {hvd.rank()}")
print("trained", step + 1, "steps")""", "%hvd stop"]


@pytest.mark.parametrize("pool", ["mpi", "ray"])
def test_predicted_beside_measured_in_jupyterlab(tmp_path, pool):
    """`%hvd doctor` of the pool's host, then a 2-rank training cell: while it runs, its
    panel shows the efficiency the model predicts from the doctor's measurement beside the
    measured one, and how much of the gap is communication; the finished panel keeps both.
    The same cell on a local Ray pool (``--ray``): the panel is the MPI pool's (both ranks'
    lanes and timeline live, running and done badges), the start names Ray's node, and the
    Ray that the pool started is gone after ``%hvd stop``."""
    import nbformat
    import psutil
    if pool == "ray":
        pytest.importorskip("ray")
    ARTIFACTS.mkdir(exist_ok=True)
    root = tmp_path / "nb"
    root.mkdir()
    cells = [c.replace("POOL", "--ray" if pool == "ray" else "") for c in PREDICTED_CELLS]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, str(root / "predicted.ipynb"))
    pattern = re.compile(r"efficiency: measured \d+%.*predicted \d+% \(doctor: [\d.]+ Gbit/s, "
                         r"\d+ us\); (of the \d+-point gap, \d+ points? (is|are) communication|"
                         r"as predicted|better than predicted)")
    shot = ARTIFACTS / f"widgets-predicted-{pool}.png"
    ray_before = {p.pid for p in psutil.process_iter() if _is_ray(p)}
    with lab.jupyter_lab(root, ARTIFACTS / f"jupyterlab-predicted-{pool}.log") as base, \
            lab.browser(tmp_path / "profile") as ctx:
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        lab.open_notebook(page, base, "predicted.ipynb")
        lab.run_all(page)
        metrics = page.locator(".hvdm-panel .hvdm-metrics").first
        metrics.wait_for(timeout=180000)          # the doctor's probe, then the pool's start
        t0, live, running, spans = time.time(), "", False, {}
        while time.time() - t0 < 60:
            loc = metrics.locator(".hvdm-predicted")
            live = loc.first.inner_text() if loc.count() else ""
            spans = page.evaluate(SPANS_JS)
            lanes = lane_text(page, 0), lane_text(page, 1)
            running = page.locator(".jp-InputPrompt:has-text('[*]')").count() > 0
            streamed = all("step 300 rank" in t for t in lanes) and \
                all(spans.get(f"{r}:collective", 0) > 5 for r in (0, 1))
            if (live and streamed) or not running:
                break
            time.sleep(0.3)
        page.screenshot(path=str(shot), full_page=True)
        assert running and pattern.search(live), (live, metrics.inner_text())
        assert streamed, (spans, lanes)
        badges = page.locator(".hvdm-badge").all_inner_texts()
        assert any("rank 1: running" in b for b in badges), badges
        page.locator(".hvdm-panel .hvdm-badge:has-text('rank 1: done')").first.wait_for(
            timeout=120000)
        final = page.locator(".hvdm-metrics").first.inner_text()
        page.screenshot(path=str(shot), full_page=True)
        assert pattern.search(final), final
        if pool == "ray":
            out = page.locator(".jp-OutputArea-output").all_inner_texts()
            assert any("local Ray, 1 node" in t for t in out), out
        assert not [e for e in errors if "bokeh" in e.lower()], errors
        # the last cell, %hvd stop: done when no prompt is busy; then, with the kernel still
        # up, none of the Ray processes the pool started is left
        deadline = time.time() + 60
        while page.locator(".jp-InputPrompt:has-text('[*]')").count() and time.time() < deadline:
            time.sleep(0.3)
        deadline = time.time() + 10
        while True:
            left = [p for p in psutil.process_iter() if _is_ray(p) and p.pid not in ray_before]
            if not left or time.time() > deadline:
                break
            time.sleep(0.3)
        assert left == [], left


def _is_ray(proc) -> bool:
    try:
        return any(w in " ".join(proc.cmdline()) for w in ("raylet", "gcs_server", "ray::"))
    except Exception:  # noqa: BLE001 (gone, or not ours to read)
        return False
