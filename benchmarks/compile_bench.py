"""torch.compile over odb's batches: graphs compiled and steady-state real tokens/s, with and without shape_buckets.

    PYTHONPATH=src .venv/bin/python benchmarks/compile_bench.py [--samples 600] [--epochs 3] [--quick]

Training: a tiny Llama (1 layer, hidden 128, vocab 256, random weights; CPU, 1 thread) trains
with AdamW on odb's batches of one seeded epoch of --samples samples (log-normal lengths, mean
120, CV 0.5, clipped to [8, 512]; token_budget=2048). Each arm builds a fresh model from the
same seed and trains 1 + --epochs epochs: the first compiles (its wall time less a steady
epoch's is the compile time), the next ones are timed, and the table gives their median real
tokens/s (tokens of the samples, not padding). Arms, in order: eager (no compile; run first
and again last, to show how much the machine's load moved the figures); ``torch.compile(model)``
(automatic dynamic shapes); ``dynamic=False``; the three again with ``shape_buckets=8`` (lengths
halving from the budget: 16 .. 2048).

Inductor compiles (it runs on this CPU), from scratch (the FX graph cache is off). Graphs are
counted by a backend that counts the graphs dynamo hands it and passes each on to
``torch._inductor.compile``. dynamo's default recompile limit (8 per function) stays: beyond
it a new shape runs uncompiled, which is what a user of dynamic=False gets. "later" counts
graphs compiled after the first epoch (odb's batches change with the epoch, so a static graph
per shape keeps compiling for shapes not seen yet). Token efficiency is real / padded tokens
of the first epoch, from the step infos: the padding the option costs.

Planning only (no model): distinct (B, L) shapes and token efficiency of one epoch of the
benchmark workloads (odb.plan.windows.window.plan_stream, as the loader plans), without the option, with
shape_buckets=8, and with a grid fitted to the epoch's lengths (odb.fit_buckets, 6 lengths).

No GPU here: CUDA graphs (mode="reduce-overhead") are not measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

import odb

BUDGET = 2048
VOCAB = 256
MODEL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=1024)


def lengths_for(n: int, seed: int = 1) -> List[int]:
    sigma2 = np.log1p(0.5 ** 2)
    x = np.random.default_rng(seed).lognormal(np.log(120.0) - sigma2 / 2, np.sqrt(sigma2), size=n)
    return np.clip(np.rint(x), 8, 512).astype(int).tolist()


class Samples(torch.utils.data.Dataset):
    def __init__(self, lengths: List[int]) -> None:
        rng = np.random.default_rng(0)
        self.rows = [torch.as_tensor(rng.integers(1, VOCAB, size=n), dtype=torch.long) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Pads to the longest sample, as transformers' DataCollatorForSeq2Seq does (odb pads on to the bucket)."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class Counting:
    """A torch.compile backend: counts each graph dynamo hands it, then compiles it with inductor."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Any:
        self.graphs += 1
        return torch._inductor.compile(gm, example_inputs)


def run_arm(lengths: List[int], mode: Optional[str], dynamic: Optional[bool], buckets: Any, epochs: int
            ) -> Dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    counter = Counting()
    step_model = model if mode is None else torch.compile(model, backend=counter, dynamic=dynamic)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = odb.ODBDataLoader(Samples(lengths), token_budget=BUDGET, shuffle=True, seed=0, collate_fn=collate,
                               shift_labels=True, shape_buckets=buckets)
    walls, rates, graphs, shapes = [], [], [], set()
    real = padded = 0
    for epoch in range(1 + epochs):
        loader.set_epoch(epoch)
        before, tokens = counter.graphs, 0
        t0 = time.perf_counter()
        for batch in loader:
            info = odb.pop_step_info(batch)
            loss = odb.scale_loss(step_model(**batch).loss, info)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += info.real_tokens
            if epoch == 0:
                shapes.add(tuple(batch["input_ids"].shape))
                real, padded = real + info.real_tokens, padded + info.padded_tokens
        walls.append(time.perf_counter() - t0)
        rates.append(tokens / walls[-1])
        graphs.append(counter.graphs - before)
        if not np.isfinite(loss.item()):
            raise RuntimeError(f"arm {mode} {dynamic} {buckets}: loss {loss.item()} at epoch {epoch}")
    steady = walls[1:]
    return {"graphs": sum(graphs), "graphs_first": graphs[0], "graphs_later": sum(graphs[1:]), "shapes": len(shapes),
            "tokens_per_s": statistics.median(rates[1:]), "rates": rates[1:], "efficiency": real / padded,
            "compile_s": walls[0] - statistics.median(steady)}


def planning_rows(quick: bool) -> List[str]:
    """Distinct shapes, steps and token efficiency of one planned epoch per workload and grid."""
    from odb.bench.workloads import lognormal_lengths, pareto_lengths
    from odb.plan.costs.cost import CostModel
    from odb.plan.windows.window import flatten, plan_stream

    n = 600 if quick else 2000
    workloads = {
        f"this benchmark's ({n} samples, budget {BUDGET})": (np.asarray(lengths_for(n)), BUDGET),
        f"lognormal CV 0.29 ({n}, budget 16384)": (lognormal_lengths(700.0, 0.29, n, seed=1), 16384),
        f"lognormal CV 1.00 ({n}, budget 16384)": (lognormal_lengths(900.0, 1.00, n, seed=1), 16384),
        f"Pareto a=1.2 ({n}, budget 16384)": (pareto_lengths(1.2, n, seed=1), 16384),
    }
    rows = []
    for name, (lengths, budget) in workloads.items():
        cells = []
        for grid in (None, 8, odb.fit_buckets(lengths, 6, multiple=8, budget=budget)):
            cfg = odb.ODBConfig(token_budget=budget, shape_buckets=grid)
            groups, _ = flatten(plan_stream(lengths, cfg))
            cost = CostModel.from_config(cfg)
            shapes = [(len(g), int(cost.pad(lengths[g][:, None]).max())) for g in groups]
            real = int(sum(lengths[g].sum() for g in groups))
            cells.append(f"{len(set(shapes))} / {len(groups)} / {real / sum(b * w for b, w in shapes):.3f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs after the first (median)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 120 samples, 1 timed epoch, fewer arms")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.epochs = 120, 1
    torch.set_num_threads(1)  # steadier on a shared machine; the model is tiny
    torch._inductor.config.fx_graph_cache = False  # compile from scratch: what a first run costs
    lengths = lengths_for(args.samples)
    arms: List[Tuple[str, Optional[str], Optional[bool], Any]] = [
        ("eager", None, None, None),
        ("compile default (dynamic=None)", "compile", None, None),
        ("compile dynamic=False", "compile", False, None),
        ("eager + shape_buckets=8", None, None, 8),
        ("compile default + shape_buckets=8", "compile", None, 8),
        ("compile dynamic=False + shape_buckets=8", "compile", False, 8),
        ("eager (again)", None, None, None),
    ]
    if args.quick:
        arms = [a for a in arms if a[2] is not False or a[3] is not None]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, {os.cpu_count()} CPUs, commit {commit}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{args.samples} samples, token_budget={BUDGET}, median of {args.epochs} timed epochs after the first\n")
    print("| arm | distinct (B, L) in epoch 1 | graphs (epoch 1 + later) | compile s | real tokens/s (epochs' range) "
          "| vs eager | token efficiency |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for name, mode, dynamic, buckets in arms:
        r = run_arm(lengths, mode, dynamic, buckets, args.epochs)
        base = base if base is not None else r["tokens_per_s"]
        graphs = "-" if mode is None else f"{r['graphs']} ({r['graphs_first']} + {r['graphs_later']})"
        compile_s = "-" if mode is None else f"{r['compile_s']:.0f}"
        spread = f"{min(r['rates']) / 1000:.1f}-{max(r['rates']) / 1000:.1f}k"
        print(f"| {name} | {r['shapes']} | {graphs} | {compile_s} | {r['tokens_per_s']:,.0f} ({spread}) | "
              f"{r['tokens_per_s'] / base:.2f} | {r['efficiency']:.3f} |", flush=True)
    print(f"\nload average at the end of training {os.getloadavg()[0]:.1f}\n")
    print("Planning only: distinct (B, L) / steps / token efficiency of one epoch\n")
    print("| workload | no option | shape_buckets=8 | fit_buckets(lengths, 6) |")
    print("|---|---|---|---|")
    for row in planning_rows(args.quick):
        print(row)


if __name__ == "__main__":
    main()
