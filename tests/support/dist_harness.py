"""Run a worker function of dist_workers.py on W real processes joined by a gloo group.

    results = run_ranks("exactly_once", world=2, params={...}, tmp=tmp_path)

Each rank is a process of its own, forked from a server process (multiprocessing's forkserver, started
once per test session) that imported torch, transformers and odb once: nothing is inherited from pytest,
and a rank starts in a fraction of a second instead of the seconds an interpreter takes to import them.
It redirects its output to its log, takes the test's environment, joins ``init_process_group("gloo")``
on a free local port,
calls ``dist_workers.<worker>(rank, world, params)`` (or ``<module>.<function>`` for a
worker named ``"module:function"``, a module of tests/) and saves what it returns with
torch.save. The parent waits until every rank has a result, an error or has exited,
within one deadline; then it kills what is left. It fails naming the ranks that did not
finish, or quoting a rank's traceback with its rank number. A rank listed in
``expect_dead`` may exit without a result (rank-death tests).
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import multiprocessing
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional

HERE = Path(__file__).resolve().parent
GRACE_S = 5.0  # after a result, how long a rank may take to exit before it is killed


class RankFailure(AssertionError):
    """A rank raised, exited without a result, or did not finish before the deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, world: int, params: Dict[str, Any], tmp: Path, *, deadline_s: float = 90.0,
              expect_dead: Collection[int] = ()) -> List[Optional[Any]]:
    """Every rank's return value (None for a rank of expect_dead that died)."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "params.json").write_text(json.dumps(params))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(world):
        argv = [worker, str(rank), str(world), str(port), str(tmp), str(deadline_s)]
        proc = _forkserver().Process(target=_forked_main, args=(argv, str(tmp / f"rank{rank}.log"), env,
                                                                 str(HERE.parents[1])), name=f"rank{rank}")
        proc.start()
        procs.append(proc)
    try:
        _wait(procs, tmp, time.monotonic() + deadline_s, deadline_s, set(expect_dead))
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    import torch

    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) if (tmp / f"rank{r}.pt").exists() else None
            for r in range(world)]


def _wait(procs: List[multiprocessing.Process], tmp: Path, deadline: float, deadline_s: float, expect_dead: set) -> None:
    def finished(r: int) -> bool:
        return (tmp / f"rank{r}.pt").exists() or (tmp / f"rank{r}.err").exists() or procs[r].exitcode is not None

    while time.monotonic() < deadline:
        for r in range(len(procs)):
            if (tmp / f"rank{r}.err").exists():
                _kill(procs)
                raise RankFailure(f"rank {r} raised:\n{(tmp / f'rank{r}.err').read_text()}"
                                  f"{_unfinished(procs, tmp)}")
            code = procs[r].exitcode  # negative: killed by that signal
            if code is not None and not (tmp / f"rank{r}.pt").exists() and r not in expect_dead:
                _kill(procs)
                raise RankFailure(f"rank {r} exited with code {code} without a result; its output ends:\n"
                                  f"{_tail(tmp, r)}{_unfinished(procs, tmp)}")
        if all(finished(r) for r in range(len(procs))):
            break
        time.sleep(0.05)
    else:
        late = [r for r in range(len(procs)) if not finished(r)]
        _kill(procs)
        logs = "".join(f"\n--- rank {r} output ends:\n{_tail(tmp, r)}" for r in late)
        raise RankFailure(f"rank(s) {late} did not finish within {deadline_s:.0f} s (killed){logs}")
    end = time.monotonic() + GRACE_S
    while time.monotonic() < end and any(p.exitcode is None for p in procs):
        time.sleep(0.05)


def _kill(procs: List[multiprocessing.Process]) -> None:
    for p in procs:
        if p.exitcode is None:
            p.kill()


def _unfinished(procs: List[multiprocessing.Process], tmp: Path) -> str:
    late = [r for r in range(len(procs)) if not (tmp / f"rank{r}.pt").exists() and not (tmp / f"rank{r}.err").exists()]
    return f"\n(rank(s) {late} had not finished and were killed)" if late else ""


def _tail(tmp: Path, rank: int, chars: int = 8000) -> str:
    path = tmp / f"rank{rank}.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


def _worker_module(name: str) -> Any:
    """A module of tests/support/ (on sys.path: this script's folder), or a test module of a layer folder
    (tests/<layer>/<name>.py) that holds its own rank workers."""
    import importlib
    import importlib.util

    if (HERE / f"{name}.py").exists():
        return importlib.import_module(name)
    found = sorted(HERE.parent.glob(f"*/{name}.py"))
    if len(found) != 1:
        raise ModuleNotFoundError(f"dist_harness: no single worker module {name!r} in tests/support or tests/*/ "
                                  f"(found {[str(p) for p in found]})")
    spec = importlib.util.spec_from_file_location(name, found[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def save_result(result: Any, tmp: Path, rank: int) -> None:
    """Rank ``rank``'s result where ``run_ranks`` reads it (written whole, then renamed). A rank worker that is
    about to be killed saves its own this way."""
    import torch

    part = tmp / f"rank{rank}.pt.part"
    torch.save(result, part)
    os.replace(part, tmp / f"rank{rank}.pt")


def _child_main(argv: List[str]) -> None:
    worker, rank, world, port, tmp, deadline_s = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4]), \
        float(argv[5])
    # A rank still running shortly before the deadline writes every thread's stack to its log, which the
    # parent quotes when it kills it: a hang names where it waits.
    faulthandler.dump_traceback_later(max(deadline_s - 3.0, 1.0), exit=False)
    try:
        import torch
        import torch.distributed as dist

        module_name, _, func_name = worker.rpartition(":")  # "module:function", or a dist_workers function
        workers = _worker_module(module_name or "dist_workers")

        torch.set_num_threads(1)
        params = json.loads((tmp / "params.json").read_text())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=deadline_s))
        save_result(getattr(workers, func_name)(rank, world, params), tmp, rank)
    except BaseException:
        (tmp / f"rank{rank}.err.part").write_text(traceback.format_exc())
        os.replace(tmp / f"rank{rank}.err.part", tmp / f"rank{rank}.err")
        sys.exit(1)
    try:
        dist.destroy_process_group()
    except Exception:  # the result is saved; a peer that already left does not matter
        pass


# What the server imports once, before it forks any rank: what every rank imports, and the frameworks that most
# rank workers use (a module that does not import in a test environment is left out: the rank imports what it
# needs itself, and fails there if it must). Installed modules only: the server does not see tests/support.
# pytest: a rank imports the parent's main module (python -m pytest), as a spawned process does.
PRELOAD = ["pytest", "numpy", "torch", "torch.distributed", "odb", "odb.integrations.hf", "odb.integrations.accelerate",
           "transformers.models.llama.modeling_llama", "transformers.trainer"]
_SERVER: List[Any] = []


def _forkserver() -> Any:
    """multiprocessing's forkserver context, its server preloading ``PRELOAD``."""
    if not _SERVER:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _SERVER.append(ctx)
    return _SERVER[0]


def _forked_main(argv: List[str], log: str, env: Dict[str, str], cwd: str) -> None:
    """A rank, in a process forked from the server: its output to ``log``, the test's environment and
    working folder, then ``_child_main``, then what an interpreter runs at exit."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # As in a fresh interpreter: HF's collators ask for the main process by name, and a rank's DataLoader workers
    # are its own children (forked from it, SIGCHLD to it), not the server's ("forkserver" is the start method
    # multiprocessing set for this process).
    multiprocessing.current_process().name = "MainProcess"
    multiprocessing.set_start_method(None, force=True)
    try:
        _child_main(argv)
    finally:
        atexit._run_exitfuncs()  # torch's and odb's exit hooks, as a fresh interpreter runs them


if __name__ == "__main__":
    _child_main(sys.argv[1:])
