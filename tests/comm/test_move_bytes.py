"""``RankExchange.move`` moves bytes between ranks exactly, and a failing, dead or stalled rank makes the others
raise instead of hanging.

Ranks that are threads (``ThreadRanks``) check the round trip for W = 1, 2, 3, 5 with random payloads;
real gloo ranks (tests/support/move_workers.py through dist_harness, marked ``dist``) check consecutive moves
between ordinary all_gathers, parts of ~1 MB and empty ones, a rank that announces its failure at a move's
size gather (the others raise ``ODBRankFailed`` naming it), and a rank that is killed or stalls (the others
raise the exchange error within the exchange timeout).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, List, Optional

import numpy as np
import pytest
import torch

from dist_harness import run_ranks
from move_workers import digest, payload
from odb.comm.protocol import (ODBExchangeError, ODBRankFailed, RankExchange, move_header_shape,
                                 outgoing_sizes)
from odb.comm.threads import ThreadRanks

DEADLINE_S = 45.0
TIMEOUT_S = 10.0  # the exchange timeout of the death tests: the survivors must raise well within the deadline


def run_threads(world: int, body: Callable[[RankExchange], Any], timeout_s: float = 10.0) -> List[Any]:
    """``body(exchange)`` on ``world`` thread ranks; each rank's result, or the error it raised."""
    ranks = ThreadRanks(world, timeout_s=timeout_s)
    out: List[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = body(ranks.exchanges(rank)(timeout_s))
        except Exception as err:  # the test looks at it
            out[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3)
    return out


def random_parts(rng: np.random.Generator, world: int, silent: Optional[int]) -> List[List[bytes]]:
    """parts[s][d]: random bytes s sends to d, about a third of them empty; rank ``silent`` sends nothing."""
    parts = []
    for s in range(world):
        sizes = rng.choice([0, 0, 1, 5, 300, 70_000], size=world)
        if s == silent:
            sizes[:] = 0
        parts.append([rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes])
    return parts


# ---- ranks that are threads ----------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_thread_ranks_move_random_payloads_exactly(world):
    rng = np.random.default_rng(world)
    rounds = [random_parts(rng, world, silent=(k % world) if k % 2 else None) for k in range(4)]
    rounds.append([[b""] * world for _ in range(world)])  # nothing crosses at all

    def body(ex: RankExchange) -> List[List[bytes]]:
        got = []
        for k, parts in enumerate(rounds):
            ex.all_gather(np.array([k]), f"gather {k}")
            got.append(ex.move(parts[ex.rank], f"move {k}"))
        return got

    out = run_threads(world, body)
    for rank, got in enumerate(out):
        assert not isinstance(got, BaseException), got
        for k, parts in enumerate(rounds):
            assert got[k] == [parts[s][rank] for s in range(world)], f"rank {rank}, move {k}"
            assert got[k][rank] is parts[rank][rank], "a rank's own part comes back untouched"


def test_thread_ranks_copy_a_bytearray_its_sender_changes_afterwards():
    sent = [bytearray(b"abc"), bytearray(b"xyz")]

    def body(ex: RankExchange) -> List[bytes]:
        outgoing = [sent[ex.rank]] * 2
        got = ex.move(outgoing, "move")
        ex.all_gather(np.array([0]), "every rank has its column")
        sent[ex.rank][0] = ord("!")
        ex.all_gather(np.array([0]), "every rank has changed its own")
        return got

    out = run_threads(2, body)
    assert out[0][1] == b"xyz" and out[1][0] == b"abc"


def test_a_rank_that_announces_at_a_move_stops_the_others_with_its_reason():
    def body(ex: RankExchange) -> Any:
        ex.move([b"warm"] * ex.world_size, "move 0")
        if ex.rank == 2:
            ex.announce(move_header_shape(ex.world_size), "move 1", KeyError("sample 9 on purpose"))
            return "announced"
        return ex.move([b"x" * 10] * ex.world_size, "move 1")

    out = run_threads(3, body)
    assert out[2] == "announced"
    for rank in (0, 1):
        err = out[rank]
        assert isinstance(err, ODBRankFailed) and err.rank == 2, err
        assert re.search(rf"odb rank {rank} of 3: rank 2 failed at move 1 \(KeyError: .*sample 9 on purpose",
                         str(err)), str(err)


def test_a_thread_rank_that_never_comes_makes_the_others_raise_after_the_timeout():
    def body(ex: RankExchange) -> Any:
        if ex.rank == 1:
            return "away"
        return ex.move([b"a", b"b"], "move 0")

    out = run_threads(2, body, timeout_s=0.5)
    assert isinstance(out[0], ODBExchangeError) and not isinstance(out[0], ODBRankFailed), out[0]
    assert "odb rank 0 of 2: the metadata exchange at move 0 failed" in str(out[0])


def test_ranks_out_of_step_name_the_bug_instead_of_mixing_messages():
    def body(ex: RankExchange) -> Any:
        if ex.rank == 0:
            return ex.transport.exchange_bytes([b"", b"a"], np.array([[0, 1], [0, 0]]), "move 0")
        return ex.transport.gather(np.array([1]), "move 0")

    out = run_threads(2, body)
    for err in out:
        assert isinstance(err, ODBExchangeError) and "out of step" in str(err), err


def test_move_refuses_parts_that_are_not_one_bytes_per_rank():
    ex = RankExchange(1.0, transport=ThreadRanks(2).transport(0))
    with pytest.raises(ValueError, match=r"move got 1 outgoing parts; it takes one per rank.*Fix"):
        ex.move([b"a"], "move 0")
    with pytest.raises(TypeError, match=r"outgoing\[1\] of type str; the parts are bytes.*pickle"):
        ex.move([b"a", "b"], "move 0")
    assert not ex.dead, "a refused call runs no collective: the exchange stays usable"
    assert outgoing_sizes([b"ab", bytearray(3)], 1, 2).tolist() == [2, 0]


def test_an_exchange_that_failed_takes_no_move():
    ex = RankExchange(1.0, transport=ThreadRanks(1).transport(0))
    ex.dead = True
    with pytest.raises(ODBExchangeError, match="used after it failed"):
        ex.move([b"a"], "move 3")


# ---- the gloo transport's error handling, without processes ----------------------------------------


class FakeWork:
    """A posted all-to-all whose first ``fails`` waits raise (a signal handler's error, or its own), done or
    not; ``exception()`` raises TypeError as torch before 2.7 does."""

    def __init__(self, fails: int, completed: bool) -> None:
        self.fails, self.completed = fails, completed

    def wait(self) -> bool:
        if self.fails:
            self.fails -= 1
            raise RuntimeError("DataLoader worker (pid 42) was killed by signal: Killed")
        return True

    def is_completed(self) -> bool:
        return self.completed

    def exception(self) -> Any:
        raise TypeError("Unable to convert function return value to a Python type")


def fake_transport(monkeypatch, work: FakeWork) -> Any:
    from odb.comm import dist as odb_dist

    def all_to_all_single(target, source, recv, send, group, async_op):
        target.copy_(torch.tensor(list(b"hi"), dtype=torch.uint8))
        return work

    monkeypatch.setattr(odb_dist.dist, "all_to_all_single", all_to_all_single)
    transport = object.__new__(odb_dist.GlooTransport)  # no group: the collective is the fake above
    transport.rank, transport.world_size, transport.timeout_s = 0, 2, 5.0
    transport.group, transport.owns_group, transport.interrupted = None, False, None
    return transport


def test_a_signal_error_while_the_bytes_went_through_is_kept_for_after_the_exchange(monkeypatch):
    transport = fake_transport(monkeypatch, FakeWork(fails=1, completed=True))
    got = transport.exchange_bytes([b"own", b"abc"], np.array([[0, 3], [2, 0]]), "move 5")
    assert got == [b"own", b"hi"]
    assert "DataLoader worker" in str(transport.interrupted), "raised once the exchange is over"


def test_a_failed_all_to_all_is_the_exchange_error_naming_rank_and_where(monkeypatch):
    transport = fake_transport(monkeypatch, FakeWork(fails=99, completed=True))
    with pytest.raises(ODBExchangeError, match=r"odb rank 0 of 2: the metadata exchange at move 5 failed"):
        transport.exchange_bytes([b"own", b"abc"], np.array([[0, 3], [2, 0]]), "move 5")
    assert transport.interrupted is None


def test_nothing_crossing_runs_no_collective(monkeypatch):
    transport = fake_transport(monkeypatch, FakeWork(fails=99, completed=True))  # would fail if posted
    assert transport.exchange_bytes([b"own", b""], np.array([[3, 0], [0, 9]]), "move 0") == [b"own", b""]


# ---- real gloo ranks ----------------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_move_bytes_exactly_between_gathers(tmp_path, world):
    rounds = 6
    results = run_ranks("move_workers:moves", world, dict(rounds=rounds, timeout_s=60.0), tmp_path,
                        deadline_s=DEADLINE_S)
    for rank, out in enumerate(results):
        assert out["own_is_same"], "a rank's own part comes back as the very object it passed"
        for r in range(rounds):
            want = [(len(payload(r, s, rank)), digest(payload(r, s, rank))) for s in range(world)]
            assert [tuple(x) for x in out["got"][r]] == want, f"rank {rank}, move {r}"
            assert out["gathers"][2 * r] == [v for s in range(world) for v in (r, s)]
            assert out["gathers"][2 * r + 1] == [r * 10 + s for s in range(world) for _ in range(3)]
    assert any(n >= 1 << 20 for n, _ in results[0]["got"][0]), "the first move carries ~1 MB parts"


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_gloo_rank_that_fails_before_a_move_stops_the_others_naming_it(tmp_path):
    results = run_ranks("move_workers:fails_before_move", 3, dict(failing=1, timeout_s=600.0), tmp_path,
                        deadline_s=DEADLINE_S)
    assert results[1]["type"] == "announced"
    for rank in (0, 2):
        out = results[rank]
        assert out["type"] == "ODBRankFailed" and out["failed_rank"] == 1, out
        assert re.search(rf"odb rank {rank} of 3: rank 1 failed at move 2 \(ValueError: sample 12 cannot be "
                         rf"encoded on purpose\)", out["error"]), out["error"]
        assert out["dead"], "an exchange that saw a failure takes no more collectives"
        assert out["elapsed"] < 6.0, f"rank {rank} raised after {out['elapsed']:.1f} s (the failing rank waited 1 s)"


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["killed", "killed_after_sizes", "stalls_after_sizes"])
def test_a_gloo_rank_that_dies_or_stalls_at_a_move_makes_the_others_raise(tmp_path, how):
    params = dict(dying=1, how=how, timeout_s=TIMEOUT_S, stall_s=TIMEOUT_S + 2, tmp=str(tmp_path))
    dead = {} if how == "stalls_after_sizes" else {1}
    results = run_ranks("move_workers:dies_before_move", 2, params, tmp_path, deadline_s=DEADLINE_S,
                        expect_dead=dead)
    out = results[0]
    assert "ODBExchangeError" in out["mro"] and out["type"] != "ODBRankFailed", out
    assert "odb rank 0 of 2: the metadata exchange at move 1 failed" in out["error"], out["error"]
    assert out["dead"]
    assert out["elapsed"] < TIMEOUT_S + 5, f"rank 0 raised after {out['elapsed']:.1f} s"
    # killed before the move: its size gather fails; after the sizes: the bytes' all-to-all does
    assert ("exchange_bytes" in out["frames"]) == how.endswith("after_sizes"), out["frames"]
