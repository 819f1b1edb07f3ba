"""Start the training benchmark's processes: 1, or W ranks joined by a gloo group on a free local port.

``launch(params, world, timeout_s)`` starts ``python -m odb.bench.training_ddp`` once per
rank (a fresh interpreter each, ``torch.set_num_threads(threads)``), waits for all of
them within one deadline, kills what is left after it (after asking each for its threads' stacks,
which the error then shows), and returns rank 0's result.
A rank that fails is reported with the end of its output. Rank 0's progress lines go to
the parent's stderr.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


def launch(params: Dict[str, Any], world: int, timeout_s: float = 900.0,
           worker: Sequence[str] = ("-m", "odb.bench.training_ddp")) -> Dict[str, Any]:
    """Run ``run_worker`` on ``world`` processes; rank 0's result (a JSON-able dict).

    ``worker``: what each process runs after ``python`` (it receives rank, world, port, folder and timeout and
    calls ``child_main``): this module by default; a script that sets something up first (e.g.
    ``benchmarks/convergence_float64.py``) otherwise."""
    if world < 1:
        raise ValueError(f"launch: world={world} must be at least 1 process.")
    with tempfile.TemporaryDirectory(prefix="odb-train-") as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "params.json").write_text(json.dumps(params))
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS=str(params.get("threads", 1)), PYTHONUNBUFFERED="1")
        procs: List[subprocess.Popen] = []
        for rank in range(world):
            log = open(tmp / f"rank{rank}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, *worker, str(rank), str(world), str(port), str(tmp), str(timeout_s)],
                stdout=log, stderr=None if rank == 0 else subprocess.STDOUT, env=env))
            log.close()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or all(p.poll() == 0 for p in procs):
                    break
                time.sleep(0.1)
        finally:
            late = [r for r, p in enumerate(procs) if p.poll() is None]
            if late and hasattr(signal, "SIGUSR1"):  # a hung rank: its threads' stacks say where it waits
                for r in late:
                    procs[r].send_signal(signal.SIGUSR1)
                time.sleep(2.0)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        errors = [(r, (tmp / f"rank{r}.err").read_text()) for r in range(world) if (tmp / f"rank{r}.err").exists()]
        if errors:
            r, text = errors[0]
            raise RuntimeError(f"training benchmark: rank {r} of {world} raised:\n{text}")
        codes = {r: p.returncode for r, p in enumerate(procs)}
        if late or any(codes.values()) or not (tmp / "result.json").exists():
            logs = "".join(f"\n--- rank {r} (exit {codes[r]}) output ends:\n{_tail(tmp / f'rank{r}.log')}"
                           + (f"\n--- rank {r}'s threads when it was stopped:\n{_tail(tmp / f'rank{r}.stacks', 6000)}"
                              if r in late else "")
                           for r in range(world))
            what = f"did not finish within {timeout_s:.0f} s (killed: ranks {late})" if late else "failed"
            raise RuntimeError(f"training benchmark on {world} process(es) {what}.{logs}")
        result: Dict[str, Any] = json.loads((tmp / "result.json").read_text())
        return result


def child_main(argv: List[str]) -> None:
    """One process of ``launch``: ``argv`` = rank, world, port, the shared folder, the timeout in seconds."""
    rank, world, port, tmp, timeout_s = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3]), float(argv[4])
    stacks = open(tmp / f"rank{rank}.stacks", "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        import torch

        params = json.loads((tmp / "params.json").read_text())
        torch.set_num_threads(int(params.get("threads", 1)))
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))

        result = run_worker(rank, world, params)
        if world > 1:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        if rank == 0:
            (tmp / "result.tmp").write_text(json.dumps(result))
            os.replace(tmp / "result.tmp", tmp / "result.json")
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        (tmp / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)


def run_worker(rank: int, world: int, params: Dict[str, Any]) -> Dict[str, Any]:
    """What one process of ``launch`` runs: the throughput rounds, then the convergence runs."""
    import torch

    from odb.bench.convergence import run_convergence
    from odb.bench.training_run import run_throughput

    out: Dict[str, Any] = {"workloads_meta": {"world": world, "threads": torch.get_num_threads()}}
    if params.get("workloads"):
        out["workloads"] = run_throughput(rank, world, params)
    if params.get("convergence"):
        out["convergence"] = run_convergence(rank, world, {**params, **params["convergence"]})
    return out


if __name__ == "__main__":
    child_main(sys.argv[1:])
