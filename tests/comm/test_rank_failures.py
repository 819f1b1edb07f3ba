"""A failure on one rank reaches every rank within seconds; no public method but iteration runs a
collective; local loaders under torch.distributed; a re-created default group.

The multi-process tests run real gloo ranks (tests/support/failure_workers.py through dist_harness) and are
marked ``dist``. Every rank stays alive after its error and exchange_timeout_s is 600 s while the
harness deadline is 60 s: a pass proves that odb's exchange carried the failure.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch

import odb
from dist_harness import free_port, run_ranks
from odb.comm.agreement import agreed_values, check_agreement, fingerprint
from odb.comm.protocol import (FAILED, REASON_BYTES, STOPPED, ODBExchangeError, ODBOptionMismatch, ODBRankFailed,
                                 decode_reason, encode_reason, failure_of, peer_error)
from odb.epoch.pipeline import BatchPipeline

DEADLINE_S = 60.0
SPREAD_S = 10.0  # every rank raised within this many seconds of the others
BASE = dict(n=600, budget=256, failing=1)


def _run(tmp_path, **params: Any) -> List[Dict[str, Any]]:
    return run_ranks("failure_workers:one_rank_fails", 2, {**BASE, **params}, tmp_path, deadline_s=DEADLINE_S)


def _check(results: List[Dict[str, Any]], own_type: Optional[str], own_text: str, peer_text: str) -> None:
    failing = BASE["failing"]
    for rank, out in enumerate(results):
        if rank == failing:
            assert out["type"] == own_type, out
            assert own_type is None or own_text in out["error"], out["error"]
        else:
            assert out["type"] == "ODBRankFailed", out
            assert out["failed_rank"] == failing
            assert re.search(rf"odb rank {rank} of 2: rank {failing} (failed|stopped)", out["error"]), out["error"]
            assert peer_text in out["error"], out["error"]
            assert "this rank stops too" in out["error"]
    spread = max(o["t"] for o in results) - min(o["t"] for o in results)
    assert spread < SPREAD_S, f"ranks raised {spread:.1f} s apart"
    assert max(o["elapsed"] for o in results) < DEADLINE_S / 2


# ---- failures in the producer reach every rank at the same step -----------------------------------


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("how, extra, own_type, own_text", [
    ("oversize", {}, "ValueError", "exceeds token_budget=256"),
    ("collate", {}, "KeyError", "collate cannot handle sample"),
    ("collate", {"ready_batches": 0, "accumulation": 2}, "KeyError", "collate cannot handle sample"),
    ("worker", {}, "OSError", "cannot read sample"),
    ("ghost", {}, "RuntimeError", "ghost batch"),
    ("known_collate", {"accumulation": 2}, "KeyError", "collate cannot handle sample"),
], ids=["oversize", "collate", "collate-on-training-thread", "worker", "no-ghost-sample", "known-lengths-collate"])
def test_a_failing_rank_stops_every_rank_at_the_same_step(tmp_path, how, extra, own_type, own_text):
    results = _run(tmp_path, how=how, then_epoch=how in ("oversize", "collate"), **extra)
    _check(results, own_type, own_text, own_text)
    assert results[0]["steps"] == results[1]["steps"], "every rank must stop before the same step"
    if how != "ghost":
        assert results[0]["steps"] > 0, "the failure should come mid-epoch"
    if "then_ids" in results[0]:  # the processes go on: a fresh loader runs a whole epoch on every rank
        assert sorted(i for o in results for i in o["then_ids"]) == list(range(BASE["n"]))


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_an_abort_on_the_training_thread_reaches_the_other_ranks(tmp_path):
    results = _run(tmp_path, how="abort", after=5)
    _check(results, "ValueError", "supervised tokens", "supervised tokens")
    assert results[1]["steps"] == 5
    assert results[0]["steps"] >= 5  # the others learn it at their next exchange (odb plans a few steps ahead)


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_rank_that_stops_iterating_stops_the_others(tmp_path):
    results = _run(tmp_path, how="break", after=5)
    assert results[1]["type"] is None and results[1]["steps"] == 5
    _check(results, None, "", "stopped iterating its odb loader")


# ---- a worker process killed on one rank -------------------------------------------------------------

TORCH_DEATH = re.compile(r"DataLoader worker \(pid(?:\(s\))? (\d+)\)")  # torch's own words, on the failing rank
ODB_DEATH = re.compile(r"RuntimeError: DataLoader worker \(pid (\d+)\) (?:was killed by SIGKILL|is killed by "
                       r"signal: Killed)")


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world, how, extra", [
    (2, "killed", {}),
    (2, "kill_worker", {"after": 3, "step_s": 0.2, "window_budgets": 4}),
    (3, "killed_stream", {"step_s": 0.05, "window_budgets": 4}),
    (2, "killed", {"known": True}),
], ids=["waiting-for-a-batch", "inside-the-training-step", "stream-3-ranks", "known-lengths"])
def test_a_worker_killed_on_one_rank_is_named_with_its_cause_on_every_rank(tmp_path, world, how, extra):
    """A DataLoader worker of rank 1 is SIGKILLed (as the out-of-memory killer would): the dataset kills
    the worker reading a sample (map-style; a stream sharded by rank and worker; known lengths), or the
    training loop kills a worker while its step runs. torch raises the death on rank 1's training thread
    from its SIGCHLD handler: while it waits for odb's next batch, or inside the training step, where odb
    sees only a stop. The other ranks must name rank 1 and the death, with the worker's pid (before:
    "rank 1 stopped iterating its odb loader ... Fix: every rank must iterate its odb loaders in the same
    order"; with known lengths the ranks could also wait in the step exchange until exchange_timeout_s)."""
    results = run_ranks("failure_workers:one_rank_fails", world, {**BASE, "how": how, "then_epoch": True, **extra},
                        tmp_path, deadline_s=DEADLINE_S)
    own = results[1]
    assert own["type"] in ("RuntimeError", "ConnectionResetError"), own  # torch's error: the death, or its sign
    if how == "kill_worker":  # torch raised it in the training step, outside odb, or odb's watch of the workers
        # stopped the epoch first (odb.data.worker_deaths) and the death came with the next batch
        assert own["raised_in"] == "one_rank_fails" or own["error"].startswith("DataLoader worker (pid"), own
    pid = TORCH_DEATH.search(own["error"])
    for rank, out in enumerate(results):
        if rank == 1:
            continue
        assert out["type"] == "ODBRankFailed" and out["failed_rank"] == 1, out
        text = out["error"]
        assert re.match(rf"odb rank {rank} of {world}: rank 1 failed at epoch 0, [a-z -]+ \d+ \(", text), text
        death = ODB_DEATH.search(text)
        assert death, text
        assert pid is None or death.group(1) == pid.group(1), (text, own["error"])
        assert "stopped iterating" not in text and "Fix: fix the cause in rank 1's error" in text, text
    spread = max(o["t"] for o in results) - min(o["t"] for o in results)
    assert spread < SPREAD_S, f"ranks raised {spread:.1f} s apart"
    assert max(o["elapsed"] for o in results) < 15.0, [o["elapsed"] for o in results]
    # The processes go on: a fresh loader (no workers) runs a whole epoch on every rank.
    assert sorted(i for o in results for i in o["then_ids"]) == list(range(BASE["n"]))


# ---- options that change the plan --------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("option, value", [("token_budget", 300), ("gradient_accumulation_steps", 2),
                                           ("seed", 1), ("loss_scaling", "sample"), ("buffer_size", 100)])
def test_ranks_with_other_plan_options_fail_at_the_first_exchange_naming_the_option(tmp_path, option, value):
    results = _run(tmp_path, how="mismatch", option=option, value=value)
    for rank, out in enumerate(results):
        assert out["type"] == "ODBOptionMismatch", out
        assert out["steps"] == 0
        assert f"{option}=" in out["error"] and f"another value on rank(s) [{1 - rank}]" in out["error"], out["error"]
        others = [name for name in ("token_budget", "gradient_accumulation_steps", "seed", "loss_scaling",
                                    "buffer_size") if name != option]
        assert not any(f"{name}=" in out["error"].split("Rule:")[0] for name in others), out["error"]
    assert abs(results[0]["t"] - results[1]["t"]) < SPREAD_S


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_option_hashes_are_the_same_in_every_process(tmp_path):
    out = run_ranks("failure_workers:fingerprints_agree_for_equal_options", 2, {}, tmp_path, deadline_s=30)
    assert out[0]["fp"] == out[1]["fp"]


# ---- no hidden collectives, local loaders, a new default group -----------------------------------


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_rank0_alone_calls_public_methods_before_training_and_ranks_make_their_own_groups(tmp_path):
    out = run_ranks("failure_workers:rank0_public_methods_then_own_groups", 2, {"n": 300, "budget": 300}, tmp_path,
                    deadline_s=DEADLINE_S)
    assert [o["probe"] for o in out] == [3.0, 3.0] and [o["default"] for o in out] == [2.0, 2.0]
    assert [o["after"] for o in out] == [2.0, 2.0]
    assert sorted(i for o in out for i in o["ids"]) == list(range(300))
    assert out[0]["len"] > 0


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_local_loader_on_rank0_only_runs_no_exchange(tmp_path):
    out = run_ranks("failure_workers:local_loader_on_rank0", 2, {"n": 300, "n_eval": 97, "budget": 300}, tmp_path,
                    deadline_s=DEADLINE_S)
    local = out[0]["local"]
    assert out[1]["local"] is None
    assert local["ids"] == list(range(97)), "the local loader reads the whole eval set on rank 0"
    assert local["world_sizes"] == [1] and local["ghosts"] == 0 and local["state_world"] == 1
    for key in ("first", "second"):
        assert sorted(i for o in out for i in o[key]) == list(range(300))


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_destroyed_and_recreated_default_group_is_not_reused(tmp_path, num_workers):
    params = {"n": 200, "budget": 300, "num_workers": num_workers, "port": free_port()}
    out = run_ranks("failure_workers:reinit_default_group", 2, params, tmp_path, deadline_s=DEADLINE_S)
    for key in ("before", "again", "fresh"):
        assert sorted(i for o in out for i in o[key]) == list(range(200)), key
    assert [o["probe"] for o in out] == [2.0, 2.0]


# ---- one process: the pieces ------------------------------------------------------------------------


@pytest.mark.parametrize("known", [False, True], ids=["online", "known-lengths"])
def test_workers_are_forked_while_no_thread_of_odb_runs(known):
    """A process forked while another thread is inside torch (odb's batch thread in an exchange) can
    inherit a lock held forever: with known lengths and num_workers=2 under 2 gloo ranks, a worker hung
    in its first torch op about once in six epochs (both ranks then waited until exchange_timeout_s).
    The batch thread now starts once the inner loader has forked its workers."""
    import os
    import threading

    from helpers import LengthDataset, known_lengths, pad_collate

    at_fork: List[List[str]] = []
    earlier = set(threading.enumerate())  # threads of loaders that earlier tests left behind are not this one's
    os.register_at_fork(before=lambda: at_fork.append(
        [t.name for t in threading.enumerate() if t.name.startswith("odb-") and t.is_alive() and t not in earlier]))
    lengths = known_lengths(300, 1, 40, seed=3)
    loader = odb.ODBDataLoader(LengthDataset(lengths), token_budget=256, collate_fn=pad_collate, num_workers=2,
                               seed=0, shuffle=True, lengths=lengths if known else None, shift_labels=True)
    start = len(at_fork)  # register_at_fork hooks cannot be removed: count this test's forks only
    for epoch in range(2):
        ids = [i for b in loader for i in odb.pop_step_info(b).sample_ids]
        assert sorted(ids) == list(range(300))
    forks = at_fork[start:]
    assert len(forks) == 4, forks  # 2 workers per epoch
    assert forks == [[]] * 4, f"odb threads alive when a worker was forked: {forks}"


def test_a_reason_keeps_its_start_and_end_within_the_slot():
    long = "OSError: Caught OSError in DataLoader worker process 0.\n" + "frame\n" * 400 + "OSError: the cause"
    text = decode_reason(encode_reason(long))
    assert len(text.encode()) <= REASON_BYTES
    assert text.startswith("OSError: Caught") and text.endswith("OSError: the cause") and "[...]" in text
    assert decode_reason(encode_reason("é" * 2000)).strip("é [.]") == ""  # cut at character boundaries


def test_peer_error_names_the_failing_rank_first_and_a_stop_otherwise():
    err = peer_error(0, 3, "epoch 1, step 4", [0, STOPPED, FAILED], ["", "stopped", "ValueError: bad"])
    assert isinstance(err, ODBRankFailed) and isinstance(err, ODBExchangeError)
    assert err.rank == 2 and "rank 2 failed at epoch 1, step 4 (ValueError: bad); also rank(s) [1]" in str(err)
    stop = peer_error(1, 2, "epoch 0, window 2", [STOPPED, 0], ["x", ""])
    assert stop.rank == 0 and "rank 0 stopped iterating its odb loader at epoch 0, window 2" in str(stop)
    assert failure_of(None)[0] == STOPPED and failure_of(KeyError("k")) == (FAILED, "KeyError: 'k'")


def test_check_agreement_names_each_differing_option_and_the_ranks():
    mine = agreed_values(odb.ODBConfig(token_budget=64, seed=1), shuffle=True)
    other = agreed_values(odb.ODBConfig(token_budget=128, seed=1), shuffle=False)
    gathered = np.stack([fingerprint(mine), fingerprint(other), fingerprint(mine)])
    with pytest.raises(ODBOptionMismatch) as info:
        check_agreement(gathered, mine, rank=0)
    text = str(info.value)
    assert "token_budget=64 here, another value on rank(s) [1]" in text
    assert "shuffle=True here, another value on rank(s) [1]" in text
    assert "seed=" not in text.split("Rule:")[0]
    check_agreement(gathered[[0, 2]], mine, rank=1)  # equal options: nothing raised


def test_distributed_false_refuses_a_process_group_and_non_bools():
    data = [{"input_ids": torch.ones(3, dtype=torch.long)}] * 4
    with pytest.raises(ValueError, match=r"process_group=.* with distributed=False.*Fix: drop process_group"):
        odb.ODBDataLoader(data, token_budget=8, distributed=False, process_group=object(), collate_fn=list)
    with pytest.raises(TypeError, match=r"ODBConfig.distributed='no': must be a bool"):
        odb.ODBConfig(token_budget=8, distributed="no")
    loader = odb.ODBDataLoader(data, token_budget=8, distributed=False, collate_fn=list)
    assert sum(len(odb.pop_step_info(b).sample_ids) for b in loader) == 4


def _produce(fail_at: int):
    for k in range(100):
        if k == fail_at:
            raise KeyError("bad batch")
        yield k


def _fails(p: BatchPipeline) -> None:
    assert [next(p) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad batch"):
        next(p)


def _aborts(p: BatchPipeline) -> None:
    next(p)
    p.abort(ValueError("checked on the training thread"))
    with pytest.raises(ValueError, match="checked on the training thread"):
        next(p)


def _ends(p: BatchPipeline) -> None:
    assert len(list(p)) == 100


@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("use, fail_at, expected", [(_fails, 3, KeyError), (next, -1, None),
                                                    (_aborts, -1, ValueError), (_ends, -1, "nothing")],
                         ids=["failure", "stop", "abort", "end"])
def test_pipeline_announces_how_it_ended_early_once(depth, use, fail_at, expected):
    import time

    heard: List[Any] = []
    p = BatchPipeline(_produce(fail_at), depth=depth, announce=heard.append)
    use(p)
    p.close()
    end = time.monotonic() + (0.5 if expected == "nothing" else 5.0)
    while not heard and time.monotonic() < end:  # depth 0 announces on a thread of its own
        time.sleep(0.01)
    time.sleep(0.1)
    if expected == "nothing":
        assert heard == [], "an epoch that ran to its end announces nothing"
    elif expected is None:
        assert heard == [None], "a stop is announced as one"
    else:
        assert len(heard) == 1 and isinstance(heard[0], expected), heard


def test_a_pipeline_started_late_runs_its_producer_at_the_first_request_and_announces_a_stop_before():
    import time

    started: List[bool] = []

    def produce():
        started.append(True)
        yield from range(3)

    p = BatchPipeline(produce(), depth=2, start=False)
    time.sleep(0.1)
    assert started == [], "the producer must not run before the first next()"
    assert list(p) == [0, 1, 2] and started == [True]
    heard: List[Any] = []
    q = BatchPipeline(produce(), depth=2, start=False, announce=heard.append)
    q.close()  # stopped before its thread ever ran: the stop is still announced, once
    end = time.monotonic() + 5.0
    while not heard and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0.1)
    assert heard == [None] and started == [True]


def test_a_completed_gather_is_told_from_a_failed_one_where_torch_cannot_hand_its_error_over():
    """torch before 2.7 raises TypeError from Work.exception(): there the parts decide. A completed
    all_gather interrupted by torch's SIGCHLD handler (a worker died) must count as gone through, or this
    rank drops out of the exchange its peers finished with it and they wait for it until the timeout."""
    from odb.comm.dist import _UNSET, _went_through

    class OldWork:  # what torch 2.6's Work.exception() does
        def exception(self):
            raise TypeError("Unable to convert function return value to a Python type")

    local = torch.tensor([0, 5, 7])
    arrived = [torch.tensor([0, 3, 4]), local.clone()]
    assert _went_through(OldWork(), arrived, local, 1)
    missing = [torch.full_like(local, _UNSET), local.clone()]
    assert not _went_through(OldWork(), missing, local, 1)
    assert not _went_through(OldWork(), [torch.tensor([0, 3, 4]), torch.tensor([0, 5, 8])], local, 1)


def test_a_wait_left_by_a_signal_handlers_error_is_seen_through():
    """torch raises a worker's death on the main thread wherever it is: also inside the step exchange's
    wait, before the collective completed. The collective was posted and the peers complete it with this
    rank: the rank must finish it (and announce the death at the next exchange) rather than drop out."""
    from odb.comm.dist import _finish

    class Work:
        def __init__(self, outcomes):
            self.outcomes, self.done = list(outcomes), False

        def wait(self):
            outcome = self.outcomes.pop(0)
            if outcome == "signal":  # a signal handler's error, the collective still running
                raise RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly")
            self.done = True
            if outcome == "fail":  # the collective's own failure: it is then completed
                raise RuntimeError("Connection closed by peer")

        def is_completed(self):
            return self.done

    assert _finish(Work(["ok"]))
    assert _finish(Work(["signal", "ok"]))  # a second signal while finishing
    assert not _finish(Work(["fail"]))
    assert not _finish(Work(["signal", "signal", "signal"]))  # never completes: a failure, not a hang
