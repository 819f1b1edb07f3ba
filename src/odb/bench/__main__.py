"""The benchmark of ``make bench`` (and, reduced, ``make demo``): convergence at the user's settings, planner
quality, ranks, step efficiency against world size (scale), loader cost, training speed, vision-language training,
the GRPO policy update (rl_update), end to end.

    python -m odb.bench --out out/bench            # make bench: the full run (39 min on 2 cores at 8775068)
    python -m odb.bench --demo --out out/demo      # make demo: convergence and scale, reduced (odb.bench.demo)
    python -m odb.bench --out /tmp/b --quick       # tiny sizes, for the smoke test
    python -m odb.bench --out out/vlm --only-vlm   # the vision-language training section alone

Writes ``results.json``, ``summary.md`` (every table and goal) and the plots (``loss_vs_time.png``,
``training_loss.png``, ``scale.png``, ``bench.png``, ``step_metrics.png``: those its sections draw) under ``--out``.
Its output ends with a one-screen summary (odb's best arm against the best other arm, per setting:
``odb.bench.headline``) and where each plot is; the full run prints every table before it, the demo
opens with what it runs and what it leaves out. A line on stderr as each section starts (and the sections' own
progress lines), also when the output goes to a log. Offline: the model is built from a config, nothing is
downloaded. ``scripts/update_readme.py`` (``make publish``) turns a full run's results.json into README's and
docs/benchmarks.md's generated parts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from odb import __version__
from odb.bench.planning import BUFFER_SIZES, load_workloads, run_planning
from odb.bench.headline import plot_loss_vs_time, summary_lines
from odb.bench.report import plot, plot_scale, plot_step_metrics, render
from odb.bench.workloads import lognormal_lengths

# name -> (full, quick)
SIZES: Dict[str, tuple] = {
    "planning_samples": (20000, 1500),
    "loader_samples": (20000, 400),
    "loader_repeats": (5, 1),
    "loader_bs1_samples": (1500, 100),
    "train_samples": (600, 24),
    "e2e_samples": (2400, 120),
    "e2e_repeats": (3, 1),
    "packing_train_samples": (600, 24),
}


def _lines(it: Any, desc: str = "", total: Optional[int] = None, **_: Any) -> Any:
    """Progress as plain lines (about 5 per loop), for a log: no bar redraws."""
    if total is None:
        try:
            total = len(it)
        except TypeError:
            total = None
    every = max(1, (total or 0) // 5) if total else 0
    t0 = time.perf_counter()
    for i, x in enumerate(it, 1):
        yield x
        if every and (i % every == 0 or i == total):
            print(f"[bench] {desc or 'progress'}: {i}/{total} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)


def _progress() -> Callable[..., Any]:
    """tqdm bars on a terminal; plain lines when stderr is a file or a pipe (a log would fill with redraws)."""
    if not sys.stderr.isatty():
        return _lines
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return lambda it, **kw: it
    return lambda it, **kw: tqdm(it, file=sys.stderr, dynamic_ncols=True, **kw)


def _machine() -> Dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: Dict[str, Any] = {"cpu": cpu, "logical_cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__, "odb": __version__,
                            "torch_threads": torch.get_num_threads()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _load() -> Optional[List[float]]:
    """The machine's 1, 5 and 15 minute load averages: other work on the cores widens the spreads."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - platforms without it
        return None


def _git() -> Dict[str, Any]:
    """The commit the benchmarked odb comes from, and whether tracked files differ from it."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": bool(dirty) if commit else None}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m odb.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench", help="output folder (default: out/bench)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for smoke tests")
    p.add_argument("--demo", action="store_true",
                   help="make demo: the convergence and scale sections at reduced sizes (odb.bench.demo)")
    p.add_argument("--device", default="cpu", help="device of the training benchmark, e.g. cpu or cuda")
    p.add_argument("--skip-convergence", action="store_true", help="skip the convergence section (the first table)")
    p.add_argument("--only-convergence", action="store_true",
                   help="the convergence section alone (its results.json, summary.md and training_loss.png)")
    p.add_argument("--skip-train", action="store_true", help="skip the training benchmark")
    p.add_argument("--skip-scale", action="store_true",
                   help="skip the scale section (step efficiency against world size, 2 to 1,024 thread ranks)")
    p.add_argument("--skip-loader", action="store_true", help="skip the loader-cost benchmark")
    p.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end benchmark")
    p.add_argument("--skip-packing", action="store_true", help="skip the packed-layout benchmark")
    p.add_argument("--skip-auto", action="store_true", help="skip the token_budget='auto' benchmark")
    p.add_argument("--skip-vlm", action="store_true", help="skip the vision-language training benchmark")
    p.add_argument("--skip-rl", action="store_true",
                   help="skip the GRPO policy update section (TRL's GRPOTrainer with and without odb; rl_update)")
    p.add_argument("--only-vlm", action="store_true",
                   help="the vision-language training section alone (its results.json and summary.md)")
    p.add_argument("--no-real", action="store_true", help="leave out the committed real-data workloads")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    size = {k: v[1] if args.quick else v[0] for k, v in SIZES.items()}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device. "
                         f"Fix: run on a GPU machine with a CUDA build of torch, or use --device cpu.")
    os.makedirs(args.out, exist_ok=True)
    progress = _progress()
    t_all = time.perf_counter()
    results: Dict[str, Any] = {"meta": {"command": "python -m odb.bench " + " ".join(argv or sys.argv[1:]),
                                        "quick": args.quick, "sizes": size, "machine": _machine(),
                                        "git": _git(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                                        "load_average_start": _load()},
                               "wall_s": {}}

    def section(name: str) -> None:
        print(f"[bench] {name} ({(time.perf_counter() - t_all) / 60:.1f} min so far)", file=sys.stderr, flush=True)

    if args.demo:
        from odb.bench.demo import plan_lines, run_demo

        print("make demo: the benchmark's headline at reduced sizes (make bench runs all of it):\n"
              + "\n".join(plan_lines()), flush=True)
        run_demo(results, args.out, progress, section, time.perf_counter, quick=args.quick)
        return _finish(args, results, t_all)
    if args.only_vlm:
        _vlm(args, results, section)
        return _finish(args, results, t_all)
    if not args.skip_convergence:
        from odb.bench.convergence_run import run_convergence_section

        section("convergence at the user's settings: 2 ranks, 8 arms, A = 1 and 8, 3 rounds (10.7 min with 7 arms on 2 cores at 9dc16cd)")
        t0 = time.perf_counter()
        results["convergence"] = run_convergence_section(quick=args.quick, device="cpu", out_dir=args.out)
        results["wall_s"]["convergence"] = time.perf_counter() - t0
    if args.only_convergence:
        return _finish(args, results, t_all)

    section("planning")
    t0 = time.perf_counter()
    workloads = load_workloads(size["planning_samples"], real=not args.no_real,
                               log=lambda m: print(m, file=sys.stderr))
    results["planning"] = run_planning(workloads, budget=16384, buffer_sizes=BUFFER_SIZES, progress=progress)
    results["wall_s"]["planning"] = time.perf_counter() - t0

    section("ranks")
    t0 = time.perf_counter()
    try:  # the rank simulation drives odb's internals, which may change under it: report, do not stop
        from odb.bench.ranks_bench import run_ranks

        results["ranks"] = run_ranks({k: v for k, v in workloads.items() if k.startswith("lognormal")},
                                     world=8, budget=16384, buffer_size=512,
                                     align_windows=20 if args.quick else 100, progress=progress)
    except Exception as err:  # noqa: BLE001
        print(f"ranks skipped: {err!r}", file=sys.stderr)
        results["ranks"] = {"error": repr(err), "world": 8, "buffer_size": 512}
    results["wall_s"]["ranks"] = time.perf_counter() - t0

    if not args.skip_scale:
        section("scale: step efficiency against world size (2 to 1,024 thread ranks, 7 arms, 2 real length sets; "
                "about 5 min on 2 cores)")
        t0 = time.perf_counter()
        try:  # odb's global step plan is young: a failure is reported, the bench goes on
            from odb.bench.scale import run_scale

            results["scale"] = run_scale(quick=args.quick, progress=progress)
        except Exception as err:  # noqa: BLE001
            print(f"scale skipped: {err!r}", file=sys.stderr)
            results["scale"] = {"error": repr(err)}
        results["wall_s"]["scale"] = time.perf_counter() - t0

    if not args.skip_loader:
        section("loader cost")
        from odb.bench.loader_speed import run_loader_speed

        t0 = time.perf_counter()
        loader_lengths = lognormal_lengths(600.0, 0.48, size["loader_samples"])
        results["loader"] = run_loader_speed(loader_lengths, num_workers=2,
                                             budget=16384, repeats=size["loader_repeats"],
                                             warm_up_samples=min(512, size["loader_samples"]), progress=progress)
        from odb.bench.declared_check import run_declared_check

        results["loader"]["declared_check"] = run_declared_check(loader_lengths, num_workers=2, budget=16384,
                                                                 repeats=max(size["loader_repeats"], 3))
        results["wall_s"]["loader"] = time.perf_counter() - t0

    if not args.skip_train:
        section("training speed (2 ranks, then 1 process)")
        from odb.bench.training import run_training

        t0 = time.perf_counter()
        results["training"] = run_training(quick=args.quick, device=args.device, out_dir=args.out)
        results["wall_s"]["training"] = time.perf_counter() - t0

    if not args.skip_packing:
        section("packed layout")
        from odb.bench.packing import run_packing

        t0 = time.perf_counter()
        results["packing"] = run_packing(size["planning_samples"], real=not args.no_real, progress=progress)
        results["wall_s"]["packing"] = time.perf_counter() - t0

    if not args.skip_auto:
        section("token_budget='auto'")
        from odb.bench.auto_budget import run_auto_budget

        t0 = time.perf_counter()
        results["auto_budget"] = run_auto_budget(quick=args.quick, progress=progress)
        results["wall_s"]["auto_budget"] = time.perf_counter() - t0

    if not args.skip_vlm:
        _vlm(args, results, section)

    if not args.skip_rl:
        section("GRPO policy update: TRL as is and with odb on the same rollouts (2 gloo ranks), then plans on 8 to "
                "128 simulated ranks (about 2 min on 2 cores)")
        t0 = time.perf_counter()
        try:  # TRL's trainer internals may change under it: a failure is reported, the bench goes on
            from odb.bench.rl_update import run_rl_update

            results["rl_update"] = run_rl_update(quick=args.quick, progress=progress)
        except Exception as err:  # noqa: BLE001
            print(f"rl_update skipped: {err!r}", file=sys.stderr)
            results["rl_update"] = {"error": repr(err)}
        results["wall_s"]["rl_update"] = time.perf_counter() - t0

    if not args.skip_e2e:
        section("end to end")
        from odb.bench.e2e import run_e2e

        t0 = time.perf_counter()
        results["e2e"] = run_e2e(size["e2e_samples"], num_workers=2, budget=8192, repeats=size["e2e_repeats"],
                                 warm_up_samples=min(128, size["e2e_samples"]), progress=progress)
        results["wall_s"]["e2e"] = time.perf_counter() - t0

    return _finish(args, results, t_all)


def _vlm(args: argparse.Namespace, results: Dict[str, Any], section: Callable[[str], None]) -> None:
    """The vision-language training section (odb.bench.vlm_training): about 3 minutes on 2 cores."""
    from odb.bench.vlm_training import run_vlm_training

    section("vision-language training (Qwen2-VL, LLaVA; 1 process)")
    t0 = time.perf_counter()
    results["vlm_training"] = run_vlm_training(quick=args.quick)
    results["wall_s"]["vlm_training"] = time.perf_counter() - t0


def _finish(args: argparse.Namespace, results: Dict[str, Any], t_all: float) -> Dict[str, Any]:
    results["wall_s"]["total"] = time.perf_counter() - t_all
    results["meta"]["load_average_end"] = _load()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plots: List[tuple] = []  # (file, what it shows)
    if results.get("convergence"):
        plot_loss_vs_time(results["convergence"], os.path.join(args.out, "loss_vs_time.png"))
        plots += [("loss_vs_time.png", "held-out loss against training time: odb, fixed, group_by_length, TRL packing"),
                  ("training_loss.png", "convergence, every arm: loss per optimizer step and against time")]
    if results.get("scale") and "error" not in results["scale"]:
        plot_scale(results["scale"], os.path.join(args.out, "scale.png"))
        plots.append(("scale.png", "step efficiency against world size, 2 to 1,024 ranks"))
    if "planning" in results:
        plot(results, os.path.join(args.out, "bench.png"))
        plots.append(("bench.png", "planner quality, loader cost, training speed, end to end"))
    if "loader" in results:
        plot_step_metrics(results["loader"], os.path.join(args.out, "step_metrics.png"))
        plots.append(("step_metrics.png", "the loader's per-step metrics"))
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(render(results, markdown=True) + "\n")
    if not args.demo:
        print(render(results))
    print(closing_screen(results, args.out, plots))
    return results


def closing_screen(results: Dict[str, Any], out: str, plots: List[tuple]) -> str:
    """The run's last screen: the one-screen summary, where each plot is, the tables' file and the wall time."""
    demo = results["meta"].get("demo")
    title = ("== summary of make demo (reduced sizes, above; the published full run: README.md, docs/benchmarks.md)"
             if demo else "== summary")
    lines = [title, *summary_lines(results), "", "plots:"]
    lines += [f"  {os.path.join(out, name)}: {what}" for name, what in plots]
    lines += [f"every table and goal: {os.path.join(out, 'summary.md')}; every figure: "
              f"{os.path.join(out, 'results.json')}",
              "wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in results["wall_s"].items())
              + f" ({results['wall_s']['total'] / 60:.1f} min)"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
