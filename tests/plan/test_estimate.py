"""How close odb.plan.windows.estimate.estimate_steps comes to the steps the loader really runs.

The real count is the number of batches ``odb.ODBDataLoader`` itself emits over one
shuffled epoch of 20,000 samples (oversize samples alone, one step each): not the
planner's simulation (``plan_stream``), which the estimate runs, so a loader that plans
otherwise than its simulation fails here. Probes are taken as the loader takes them:
evenly spaced dataset indices. ``pytest -s tests/plan/test_estimate.py`` prints the error table.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest

import odb.plan.windows.estimate as est
from odb.bench.planning import odb_loader_run
from odb.bench.realdata import load_real_lengths
from odb.bench.workloads import encoder_decoder_lengths, lognormal_lengths, pareto_lengths
from odb.config import ODBConfig
from odb.plan.windows.estimate import DEFAULT_PROBE, estimate_steps, probe_size
from odb.plan.windows.window import flatten, oracle_groups, plan_stream

N = 20_000
BUDGETS = (16384, 4096)
TOLERANCE = 0.10


def translation_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Short translation pairs: log-normal, mean 20, CV 0.6, clipped to [1, 512]."""
    sigma2 = np.log1p(0.6 ** 2)
    x = np.random.default_rng(seed).lognormal(np.log(20.0) - sigma2 / 2, np.sqrt(sigma2), size=n)
    return np.clip(np.rint(x), 1, 512).astype(np.int64)


def workloads() -> Dict[str, np.ndarray]:
    out = {
        "lognormal-cv0.29": lognormal_lengths(700, 0.29, N, seed=1),
        "lognormal-cv0.48": lognormal_lengths(1200, 0.48, N, seed=1),
        "lognormal-cv1.00": lognormal_lengths(900, 1.0, N, seed=1),
        "translation-20": translation_lengths(N, seed=1),
        "enc-dec-pairs": encoder_decoder_lengths(N, seed=1),
        "pareto-a1.2": pareto_lengths(1.2, N, seed=1),
    }
    for name in ("sharegpt-gpt2", "gettext-en-de"):  # committed real lengths (ShareGPT has 17,545)
        out[name] = load_real_lengths(name).astype(np.int64)[:N]
    return out


def loader_steps(x: np.ndarray, cfg: ODBConfig, seed: int = 12345) -> int:
    """Batches of one epoch of ODBDataLoader (its own seeded shuffle) over a dataset of these lengths."""
    return len(odb_loader_run(x, cfg, seed=seed)["batches"])


def simulated_steps(x: np.ndarray, cfg: ODBConfig, seed: int = 12345) -> int:
    """Steps of the loader's planning simulation over a shuffled epoch (what the estimate extrapolates from)."""
    groups, over = flatten(plan_stream(x[np.random.default_rng(seed).permutation(len(x))], cfg))
    return len(groups) + (len(over) if cfg.oversize != "skip" else 0)


def spaced_probe(x: np.ndarray, m: int) -> np.ndarray:
    """The loader's probe: m evenly spaced dataset indices."""
    return x[np.unique(np.linspace(0, len(x) - 1, min(m, len(x))).astype(np.int64))]


def adaptive_size(read, n: int, cfg: ODBConfig) -> int:
    """The default probe: DEFAULT_PROBE samples, grown while probe_size asks for more."""
    m = DEFAULT_PROBE
    while True:
        want = probe_size(read(m), n, cfg)
        if want <= m:
            return m
        m = want


@pytest.fixture(scope="module")
def table() -> List[dict]:
    rows = []
    for budget in BUDGETS:
        cfg = ODBConfig(token_budget=budget, oversize="alone")
        for name, x in workloads().items():
            n, real = len(x), loader_steps(x, cfg)

            def err(steps: float) -> float:
                return steps / real - 1.0

            oracle = len(oracle_groups(spaced_probe(x, 128), cfg)) * n / 128  # today's len()
            m_auto = adaptive_size(lambda m: spaced_probe(x, m), n, cfg)
            random_errs = []
            for s in range(10):  # random probes, the default policy: the spread of its error
                perm = np.random.default_rng(1000 + s).permutation(n)
                m = adaptive_size(lambda k: x[perm[:k]], n, cfg)
                random_errs.append(abs(err(estimate_steps(x[perm[:m]], n, cfg, seed=s))))
            rows.append({
                "workload": name, "budget": budget, "real": real, "oracle128": err(oracle),
                "known": err(estimate_steps(x, n, cfg)),
                "p128": err(estimate_steps(spaced_probe(x, 128), n, cfg)),
                "p512": err(estimate_steps(spaced_probe(x, 512), n, cfg)),
                "need512": probe_size(spaced_probe(x, 512), n, cfg),
                "auto": err(estimate_steps(spaced_probe(x, m_auto), n, cfg)), "m_auto": m_auto,
                "rand_p90": float(np.percentile(random_errs, 90)), "rand_max": max(random_errs),
            })
    head = (f"{'workload':18} {'budget':>6} {'real':>6} {'oracle128':>9} {'known':>7} {'probe128':>8} "
            f"{'probe512':>8} {'default':>7} {'m':>6} {'rand p90':>8} {'rand max':>8}")
    print("\n" + head)
    for r in rows:
        print(f"{r['workload']:18} {r['budget']:>6} {r['real']:>6} {r['oracle128']:>+9.1%} {r['known']:>+7.1%} "
              f"{r['p128']:>+8.1%} {r['p512']:>+8.1%} {r['auto']:>+7.1%} {r['m_auto']:>6} "
              f"{r['rand_p90']:>8.1%} {r['rand_max']:>8.1%}")
    return rows


def test_known_lengths_are_nearly_exact(table: List[dict]) -> None:
    # Another shuffle than the real epoch's: only the order differs.
    for r in table:
        assert abs(r["known"]) <= 0.02, r


def test_default_probe_within_tolerance(table: List[dict]) -> None:
    """The default: a pilot of DEFAULT_PROBE (512) samples, grown to probe_size's answer."""
    for r in table:
        assert abs(r["auto"]) <= TOLERANCE, r
        assert r["rand_p90"] <= TOLERANCE, r


def test_fixed_probe_of_512_when_probe_size_says_it_suffices(table: List[dict]) -> None:
    for r in table:
        if r["need512"] <= 512:
            assert abs(r["p512"]) <= TOLERANCE, r


def test_ranks_align_to_the_most_loaded() -> None:
    from odb.epoch.simulate import simulate_ranks

    world = 4
    cfg = ODBConfig(token_budget=16384, oversize="alone")
    for name in ("lognormal-cv1.00", "enc-dec-pairs", "sharegpt-gpt2"):
        x = workloads()[name]
        x = x[np.random.default_rng(0).permutation(len(x))]
        shards = [x[r::world] for r in range(world)]
        steps = len(simulate_ranks(shards, cfg, seed=0)["infos"][0])
        for probe in (shards[0], spaced_probe(x, 2048)):
            guess = estimate_steps(probe, len(shards[0]), cfg, world_size=world)
            print(f"\n{name}: {world} ranks ran {steps} steps, estimate {guess} ({guess / steps - 1:+.1%})")
            assert abs(guess / steps - 1) <= TOLERANCE


def test_long_epochs_extrapolate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(est, "SIMULATE_MAX", 100_000)  # a third of the epoch simulated, the rest extrapolated
    cfg = ODBConfig(token_budget=16384, oversize="alone")
    for x in (lognormal_lengths(900, 1.0, 300_000, seed=2), translation_lengths(300_000, seed=2)):
        real = simulated_steps(x, cfg)  # the extrapolated part against the whole epoch simulated
        assert abs(estimate_steps(x, len(x), cfg) / real - 1) <= 0.03
        assert abs(estimate_steps(x[:4096], len(x), cfg) / real - 1) <= TOLERANCE


def test_huge_epoch_is_cheap() -> None:
    import time

    cfg = ODBConfig(token_budget=4096)
    probe = lognormal_lengths(900, 1.0, 512, seed=3)
    t0 = time.perf_counter()
    steps = estimate_steps(probe, 10_000_000, cfg)
    assert time.perf_counter() - t0 < 3.0  # ~0.5 s here; slack for slow CI machines
    assert 2_000_000 < steps < 3_500_000  # ~10M x 900 tokens / 4096, plus padding and oversize


def test_oversize_policies_and_accumulation() -> None:
    x = lognormal_lengths(900, 1.0, 5000, seed=4)
    cfg = ODBConfig(token_budget=4096)
    over = int((x > 4096).sum())
    alone = estimate_steps(x, len(x), cfg.replace(oversize="alone"))
    assert estimate_steps(x, len(x), cfg) == alone  # "error" counts as alone, never raises
    assert estimate_steps(x, len(x), cfg.replace(oversize="skip")) == alone - over
    assert estimate_steps(x, len(x), cfg.replace(gradient_accumulation_steps=8)) == alone
    assert estimate_steps(x, len(x), ODBConfig(token_budget=16)) == len(x)  # every sample oversize


def test_shapes_edges_and_determinism() -> None:
    cfg = ODBConfig(token_budget=4096)
    pairs = encoder_decoder_lengths(3000, seed=5)
    assert estimate_steps(pairs[:256], 3000, cfg, seed=7) == estimate_steps(pairs[:256], 3000, cfg, seed=7)
    assert estimate_steps(pairs[:256].tolist(), 3000, cfg) == estimate_steps(pairs[:256], 3000, cfg)
    assert estimate_steps(np.zeros((0, 2), dtype=np.int64), 100, cfg) == 0
    assert estimate_steps(np.array([], dtype=np.int64), 100, cfg) == 0
    assert estimate_steps(np.array([10]), 0, cfg) == 0
    assert estimate_steps(np.array([100]), 1000, cfg) == 25  # 40 of 100 per batch
    assert estimate_steps(np.array([[30, 70]]), 1000, ODBConfig(token_budget=(600, 1400))) == 50
    assert probe_size(np.full(10, 100), 1000, cfg) == 10  # identical lengths: any probe will do
