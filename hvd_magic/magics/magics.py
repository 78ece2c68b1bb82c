"""The IPython magics: ``%%hvd``, ``%hvd ...`` and ``%autohvd``. Thin: parse (:mod:`.args`),
call the pool (:class:`hvd_magic.kernel.PoolManager`), render (an ``OutputSink``)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from .args import CellRequest, HvdUsageError, check_ranks, parse_cell_args, parse_line_args, \
    parse_scale_args

#: First lines that keep a cell in this kernel while %autohvd is on.
LOCAL_PREFIXES = ("%hvd", "%autohvd", "%%")


def _usage(exc: BaseException) -> UsageError:
    return UsageError(str(exc))


def _status_sink() -> Any:
    """Start-up lines only (``%hvd start``/``restart`` run no cell: no live panel)."""
    from ..kernel import TextSink
    return TextSink()


def _remote(exc: BaseException) -> str:
    from ..kernel import remote_error_text
    return remote_error_text(exc)


@magics_class
class HvdMagics(Magics):
    """``%%hvd`` runs a cell on the pool's ranks; ``%hvd`` manages the pool."""

    #: Makes the renderer of one cell: ``sink_factory(stream=bool)`` -> OutputSink. The
    #: widget renderer of a later step replaces this.
    sink_factory: Callable[..., Any] = None  # type: ignore[assignment]

    def __init__(self, shell: Any, manager: Any = None) -> None:
        super().__init__(shell)
        if manager is None:
            from ..kernel.notebook.manager import PoolManager
            manager = PoolManager()
        self.manager = manager
        self.auto_line: Optional[str] = None     # %%hvd arguments while %autohvd is on
        self.last_cell: Optional[str] = None     # what `%hvd scale` re-runs without a cell
        self.history: List[Dict[str, Any]] = []  # %%hvd cells, pushes, ...: for %hvd export
        self._where: Dict[str, Any] = {}         # the pool's -H/--hostfile, for %hvd export

    def _sink(self, stream: bool = True) -> Any:
        factory = type(self).sink_factory       # through the class: a plain function stays unbound
        if factory is None:
            # Widgets in a Jupyter kernel with ipywidgets, rank-prefixed text elsewhere.
            from ..widgets import make_sink as factory
        return factory(stream=stream)

    # ------------------------------------------------------------------ %%hvd
    def _pool_for(self, req: CellRequest, sink: Any) -> Any:
        from ..runner.launch import MpiNotFoundError
        try:
            req, where = _where(req)
            if req.np is None and req.hosts is None and req.hostfile is None and not where:
                pool = self.manager.pool
                if pool is not None and pool.alive():
                    check_ranks(req, pool.size)
                    return pool
            check_ranks(req, self.manager.default_np() if req.np is None else req.np)
            return self.manager.ensure(req.np, req.hosts, req.hostfile, sink,
                                       oversubscribe=req.oversubscribe, min_np=req.min_np,
                                       **where)
        except (ValueError, TypeError, MpiNotFoundError) as exc:
            raise _usage(exc) from None

    def run_cell_on_pool(self, line: str, cell: str) -> None:
        """``%%hvd LINE`` + ``cell``: run it on the ranks, results per rank, ``--out``."""
        try:
            req = parse_cell_args(line)
        except HvdUsageError as exc:
            raise _usage(exc) from None
        sink = self._sink(req.stream)
        pool = self._pool_for(req, sink)
        self.last_cell = cell
        record = self._record_cell(req, line, cell, pool)
        slurm = getattr(self.manager, "slurm", None)
        slurm and slurm.touch(True)
        try:
            outcome = pool.run_cell(cell, sink, ranks=req.ranks, timeout=req.timeout)
        except Exception as exc:
            _slurm_note(slurm, exc)
            raise
        finally:
            slurm and slurm.touch(False)
        record["ok"] = True          # it raised otherwise (and stays marked as failed)
        if req.out:
            values = pool.result_values(outcome.ranks)
            self.shell.user_ns[req.out] = dict(zip(outcome.ranks, values))

    @line_cell_magic
    def hvd(self, line: str, cell: Optional[str] = None) -> Any:
        """%%hvd [-np N] [-H HOSTS | --hostfile F] [--ranks 0,2 | --rank 0] [--timeout S]
        [--no-stream] [--out NAME]: run the cell on every rank of the pool (started on first
        use, reused, restarted for another size or hosts). Output streams live as ``[rank]
        line``; the cell's value shows per rank; ``--out NAME`` stores ``{rank: value}``.

        %hvd status | stop | restart [-np N] | push NAME... [--ranks R,..] |
        pull NAME [--rank R] | start [-np N] | stacks: manage the pool, move variables,
        see where each rank is (``stacks``).
        """
        if line.split()[:1] == ["scale"]:
            return self._scale(line, cell)
        if cell is not None:
            self.run_cell_on_pool(line, cell)
            return None
        try:
            req = parse_line_args(line)
        except HvdUsageError as exc:
            raise _usage(exc) from None
        return getattr(self, f"_cmd_{req.command}")(req)

    def _record_cell(self, req: CellRequest, line: str, cell: str, pool: Any) -> Dict[str, Any]:
        from ..runner.export import cell_record
        if req.np is not None or req.hosts is not None or req.hostfile is not None:
            hosts = ",".join(f"{h.name}:{h.slots}" for h in req.hosts) if req.hosts else None
            self._where = {"hosts": hosts, "hostfile": req.hostfile,
                           "slurm": getattr(req, "slurm", None) or None}
        ray = getattr(getattr(self.manager, "last", None), "ray", None)   # (the pool's)
        record = cell_record(line, cell, getattr(pool, "size", None) or req.np or 1, False,
                             ray=ray, **self._where)
        self.history.append(record)
        return record

    def _scale(self, line: str, cell: Optional[str]) -> Any:
        """``%%hvd scale --np 1,2,4`` (or ``%hvd scale ...`` for the last %%hvd cell): run the
        cell at each pool size; plot throughput and efficiency against ranks."""
        try:
            nps = parse_scale_args(line)
        except HvdUsageError as exc:
            raise _usage(exc) from None
        code = cell if cell is not None else self.last_cell
        if not code:
            raise UsageError("%hvd scale: no %%hvd cell has run yet; put the code in the cell: "
                             "%%hvd scale --np 1,2,4")
        from .scale import scale
        self.history.append({"kind": "scale", "nps": nps, "source": code})
        try:
            return scale(self.manager, code, nps)
        except (ValueError, TypeError) as exc:
            raise _usage(exc) from None

    # ------------------------------------------------------------------ %hvd commands
    def _cmd_status(self, _req: Any) -> None:
        pool = self.manager.pool
        if pool is None:
            print("hvd: no pool running; the next %%hvd cell starts one")
            return
        print(render_status(pool.status()))
        held = getattr(self.manager, "slurm", None)
        info = held.info() if held is not None else None
        if isinstance(info, dict) and info:
            print(f"  slurm: job {info['job_id']} on {', '.join(info['nodes'])}"
                  + ("" if info["owned"] else " (the job this kernel runs in)"))

    def _cmd_stacks(self, _req: Any) -> None:
        """Every rank's Python stack, grouped, the user's code first: the ranks answer a
        signal, so this works while a cell runs (which goes on) or a rank holds the GIL;
        a rank that does not answer within 2 s is named."""
        pool = self._require_pool()
        from ..stacks.group import render
        print(render(pool.stacks(), title="hvd: the stacks"))

    def _cmd_profiles(self, _req: Any) -> None:
        import os
        from ..runner.profiles import describe, find_profiles, profile_dir
        where = profile_dir(os.environ)
        print(describe(find_profiles(where), where))

    def _cmd_stop(self, _req: Any) -> None:
        self.history.append({"kind": "stop"})
        print("hvd: pool stopped" if self.manager.stop() else "hvd: no pool was running")

    def _cmd_start(self, req: Any) -> None:
        self._pool_for(req.pool, _status_sink())

    def _cmd_restart(self, req: Any) -> None:
        self.manager.stop()          # then start for the request, or the last one
        self.history.append({"kind": "restart"})
        self._pool_for(req.pool, _status_sink())

    def _cmd_resize(self, req: Any) -> None:
        """``%hvd resize N``: an elastic pool (``--min-np``) grows or shrinks to N ranks."""
        self._require_pool()
        self.history.append({"kind": "resize", "np": req.pool.np})
        try:
            print(self.manager.resize(req.pool.np, _status_sink()))
        except ValueError as exc:
            raise _usage(exc) from None
        except Exception as exc:  # noqa: BLE001 - PoolError, or a rank's error: one line
            raise UsageError(_remote(exc)) from None

    def _require_pool(self) -> Any:
        pool = self.manager.pool
        if pool is None or not pool.alive():
            raise UsageError("no pool is running; run a %%hvd cell (or %hvd start -np N) first")
        return pool

    def _cmd_push(self, req: Any) -> None:
        pool = self._require_pool()
        missing = [n for n in req.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"%hvd push: {missing} not defined in this notebook")
        from ..runner.export import push_record
        self.history.append(push_record(req.names, self.shell.user_ns, req.ranks))
        try:
            pool.push({n: self.shell.user_ns[n] for n in req.names}, req.ranks)
        except ValueError as exc:
            raise _usage(exc) from None
        except Exception as exc:  # noqa: BLE001 - a rank failed or went away: one line
            raise UsageError(f"%hvd push: {_remote(exc)}") from None

    def _cmd_pull(self, req: Any) -> Any:
        pool = self._require_pool()
        name = req.names[0]
        try:
            values = pool.pull(name, None if req.rank is None else [req.rank])
        except ValueError as exc:
            raise _usage(exc) from None
        except Exception as exc:  # noqa: BLE001 - NameError on a rank, shown plainly
            raise UsageError(f"%hvd pull {name}: {_remote(exc)}") from None
        self.shell.user_ns[name] = values[0] if req.rank is not None else values
        self.history.append({"kind": "pull", "names": [name]})
        return None

    def _cmd_export(self, req: Any) -> None:
        """``%hvd export PATH``: this session's %%hvd cells as a script for hvdrun."""
        from ..runner.export import build_script
        path = req.names[0]
        try:
            made = build_script(self.history, path)
        except ValueError as exc:
            raise _usage(exc) from None
        try:
            with open(path, "w") as fh:
                fh.write(made.script)
        except OSError as exc:
            raise UsageError(f"%hvd export: cannot write {path}: {exc}") from None
        cells = sum(1 for r in self.history if r.get("kind") in ("cell", "scale"))
        print(f"hvd: wrote {cells} cell(s) to {path}; run it with:\n  {made.command}")
        for note in made.notes:
            print(f"  note: {note}")

    def _cmd_doctor(self, req: Any) -> Any:
        """``%hvd doctor ...``: a pre-flight check of the pool these arguments would start."""
        from ..runner.doctor_run import run_doctor, run_what_if
        from ..widgets.doctor import show_report, show_what_if
        from ..widgets.session import session
        model_bytes = req.doctor.get("model_bytes")
        model_name = req.doctor.get("model")
        tensors = None
        if model_name is not None and (model_name in self.shell.user_ns
                                       or not req.doctor.get("what_if")):
            if model_name not in self.shell.user_ns:
                raise UsageError(f"%hvd doctor --model {model_name}: no such variable in this "
                                 "notebook; give a torch model's name or --model-bytes B "
                                 "(with --what-if, also a torchvision or Keras model name)")
            from ..runner.doctor import gradient_bytes
            model = self.shell.user_ns[model_name]
            try:
                model_bytes = gradient_bytes(model)
            except (TypeError, ValueError) as exc:
                raise _usage(exc) from None
            tensors = sum(1 for p in model.parameters() if p.requires_grad)
        if req.doctor.get("what_if"):
            # a cluster that does not exist yet: nothing is probed, no pool starts
            try:
                forecast = run_what_if(req.doctor, model_bytes, tensors)
            except ValueError as exc:
                raise _usage(exc) from None
            show_what_if(forecast)
            return None
        for flag, dest in (("--fusion-threshold-mb", "fusion_threshold_mb"),
                           ("--cycle-time-ms", "cycle_time_ms")):
            if req.doctor.get(dest) is not None:
                raise UsageError(f"%hvd doctor {flag} goes with --what-if (the probe runs "
                                 "with the pool's own settings)")
        try:
            profile = getattr(req.pool, "profile", None)
            np = req.pool.np or (None if profile else self.manager.default_np())
            report = run_doctor(np, req.pool.hosts, req.pool.hostfile, model_bytes=model_bytes,
                                step_time=req.doctor.get("step_time"),
                                network_interface=req.doctor.get("network_interface"),
                                slurm=getattr(req.pool, "slurm", None), profile=profile)
        except (ValueError, TypeError) as exc:
            raise _usage(exc) from None
        # the links it measured: a later cell's panel predicts its efficiency from them
        session().doctor = report
        show_report(report)
        return None

    # ------------------------------------------------------------------ %autohvd
    @line_magic
    def autohvd(self, line: str) -> None:
        """%autohvd [%%hvd options] | %autohvd off: run every following cell on the pool
        (cells starting with %hvd, %autohvd or another cell magic stay here)."""
        words = line.split()
        if words[:1] in (["off"], ["0"], ["false"]):
            self.auto_line = None
            _remove_transformer(self.shell, self._transform)
            print("hvd: autohvd off; cells run in this kernel")
            return
        if words[:1] == ["on"]:
            line = " ".join(words[1:])
        try:
            parse_cell_args(line)
        except HvdUsageError as exc:
            raise _usage(exc) from None
        self.auto_line = line
        cleanup = self.shell.input_transformers_cleanup
        if self._transform not in cleanup:
            cleanup.append(self._transform)
        print("hvd: autohvd on; every cell runs on the pool until %autohvd off")

    def _transform(self, lines: List[str]) -> List[str]:
        if self.auto_line is None or not "".join(lines).strip():
            return lines
        first = next(line for line in lines if line.strip()).lstrip()
        if first.startswith(LOCAL_PREFIXES):
            return lines
        return [f"%%hvd {self.auto_line}\n"] + lines

    def close(self) -> None:
        """Stop autohvd and the pool (the extension is unloaded)."""
        _remove_transformer(self.shell, self._transform)
        self.manager.stop()


def _where(req: CellRequest) -> Any:
    """``--profile NAME`` applied (its hosts or Slurm options, ranks, environment, setup
    lines), and the keywords for the pool manager that say where the pool runs."""
    from dataclasses import replace
    where: Dict[str, Any] = {}
    if req.profile is not None:
        import os
        from ..runner.profiles import launch_of, load_profile
        plan = launch_of(load_profile(req.profile, os.environ), req.np)
        req = replace(req, np=plan.np, hosts=plan.hosts, slurm=plan.slurm,
                      ray=plan.ray if plan.ray is not None else getattr(req, "ray", None))
        if plan.env:
            where["env"] = plan.env
        if plan.setup:
            where["setup"] = plan.setup
    if req.slurm is not None:
        where["slurm"] = req.slurm
    if getattr(req, "ray", None) is not None:
        where["ray"] = req.ray
    return req, where


def _slurm_note(slurm: Any, exc: BaseException) -> None:
    """A cell failed: when the pool's Slurm allocation is the cause (a node down, the time
    limit), say so, naming the node, on the error and on stderr."""
    if slurm is None or getattr(slurm, "allocation", None) is None:
        return
    try:
        why = slurm.failure()
    except Exception:  # noqa: BLE001 - the cell's own error matters more
        return
    if isinstance(why, str) and why:
        import sys
        exc.add_note(why)
        print(f"hvd: {why}", file=sys.stderr)


def _remove_transformer(shell: Any, fn: Any) -> None:
    cleanup = shell.input_transformers_cleanup
    while fn in cleanup:
        cleanup.remove(fn)


def render_status(st: Dict[str, Any]) -> str:
    """``%hvd status`` as text: the pool, then one line per rank, then pending collectives."""
    state = "running" if st["alive"] else f"gone ({st['ended']})"
    launcher = f"mpiexec pid {st['mpiexec_pid']}, " if st["mpiexec_pid"] is not None else ""
    lines = [f"hvd pool: {st['size']} ranks, {state}; started in {st['start_s']:.1f} s; "
             f"{launcher}controller pid {st['controller_pid']}"]
    lines += [f"  note: {n}" for n in st["notes"]]
    lines.append(f"  {'rank':>4}  {'host':<16} {'pid':>7} {'nanny':>7}  {'gpu':<5} state")
    pending: List[str] = []
    for r, info in sorted(st["ranks"].items()):
        gpu = info.get("cuda_visible_devices") or "-"
        doing = info.get("state", "?")
        if info.get("init_error"):
            doing += f"; hvd.init failed: {info['init_error']}"
        lines.append(f"  {r:>4}  {str(info.get('host', '?')):<16} {str(info.get('pid', '?')):>7} "
                     f"{str(info.get('nanny') or '-'):>7}  {gpu:<5} {doing}")
        pending += [f"  rank {r}: {_pending_text(p)}" for p in info.get("pending") or []]
    lines.append("pending collectives:" if pending else "pending collectives: none")
    return "\n".join(lines + pending)


def _pending_text(p: Any) -> str:
    if not isinstance(p, dict):
        return str(p)
    missing = p.get("missing_ranks")
    waits = f"for ranks {missing}" if missing else "in flight"
    return (f"{p.get('kind', '?')} {p.get('name', '?')!r} waiting {p.get('waiting_s', 0):.1f} s "
            f"{waits} (submitted by {p.get('submitted_by')})")


def default_manager() -> Any:
    """The process-wide pool manager (one pool per kernel)."""
    global _MANAGER
    if _MANAGER is None:
        from ..kernel.notebook.manager import PoolManager
        _MANAGER = PoolManager()
    return _MANAGER


_MANAGER: Any = None


def autohvd_from_env(magics: HvdMagics) -> None:
    """Turn %autohvd on when ``HVD_MAGIC_AUTOHVD`` is set (the hvd_magic Jupyter kernel)."""
    from .. import config
    value = config.get("HVD_MAGIC_AUTOHVD")
    if value and value.lower() not in ("0", "off", "false", "no"):
        magics.autohvd("" if value.lower() in ("1", "on", "true", "yes") else value)
