"""Rank workers for tests/comm/test_move_bytes.py (run by dist_harness as "move_workers:<name>").

Every rank makes one exchange over a gloo group of its own (``odb.comm.dist.live_exchange``, as a loader
does) and moves bytes with ``RankExchange.move``. The payloads are a function of (round, source,
destination) (``payload``), so the test recomputes what each rank must have received. A rank records
what it raised and when, as the failure workers do: the test checks the type, the words and the time.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from dist_harness import save_result
from odb.comm.dist import live_exchange
from odb.comm.protocol import move_header_shape

MB = 1 << 20
SIZES = (0, 1, 17, 4096, 65_537, MB)  # what a random part may weigh: empty, tiny, odd, page, ~1 MB


def size(round_: int, src: int, dst: int) -> int:
    """Bytes ``src`` sends to ``dst`` at ``round_``: round 0 ~1 MB to everyone, round 1 nothing at all (no
    collective), round 2 rank 0 sends nothing, later rounds random picks of SIZES."""
    if round_ == 0:
        return MB - 3 * src + dst  # ~1 MB, a different length per pair (a split off by one shows)
    if round_ == 1 or (round_ == 2 and src == 0):
        return 0
    return int(np.random.default_rng([round_, src, dst]).choice(SIZES))


def payload(round_: int, src: int, dst: int) -> bytes:
    """What ``src`` sends to ``dst`` at ``round_`` (random bytes of ``size``)."""
    n = size(round_, src, dst)
    return np.random.default_rng([7, round_, src, dst]).integers(0, 256, n, dtype=np.uint8).tobytes()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record(err: BaseException, started: float) -> Dict[str, Any]:
    return {"type": type(err).__name__, "error": str(err), "failed_rank": getattr(err, "rank", None),
            "elapsed": time.monotonic() - started, "mro": [c.__name__ for c in type(err).__mro__],
            "frames": [frame.name for frame in traceback.extract_tb(err.__traceback__)]}


def moves(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """``p["rounds"]`` moves, each between two ordinary all_gathers; returns the digests (and lengths) of what
    arrived per round, the gathers' results and whether rank's own part came back as the very object.
    The group is left to odb's exit handler, which releases it once every rank is known to be done with it
    (released right after the last gather, torch 2.6 can hang in destroy_process_group)."""
    exchange = live_exchange(p["timeout_s"])
    got: List[List[Any]] = []
    gathers: List[List[int]] = []
    own_is_same = True
    for r in range(p["rounds"]):
        gathers.append(exchange.all_gather(np.array([r, rank]), f"before move {r}").ravel().tolist())
        outgoing = [payload(r, rank, d) for d in range(world)]
        incoming = exchange.move(outgoing, f"move {r}")
        own_is_same = own_is_same and incoming[rank] is outgoing[rank]
        got.append([(len(b), digest(b)) for b in incoming])
        gathers.append(exchange.all_gather(np.full(3, r * 10 + rank), f"after move {r}").ravel().tolist())
    return {"got": got, "gathers": gathers, "own_is_same": own_is_same}


def fails_before_move(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Two moves; then rank ``p["failing"]`` fails and announces at the third move's size gather (as odb does),
    a second late, while the others wait in that move."""
    exchange = live_exchange(p["timeout_s"])
    for r in range(2):
        exchange.move([payload(r, rank, d) for d in range(world)], f"move {r}")
    where = "move 2"
    started = time.monotonic()
    if rank == p["failing"]:
        time.sleep(1.0)  # the others are already waiting in the move
        err = ValueError("sample 12 cannot be encoded on purpose")
        exchange.announce(move_header_shape(world), where, err)
        return {"type": "announced", "elapsed": time.monotonic() - started, "dead": exchange.dead}
    try:
        exchange.move([payload(2, rank, d) for d in range(world)], where)
    except Exception as err:
        return {**_record(err, started), "dead": exchange.dead}
    return {"type": None, "elapsed": time.monotonic() - started}


def dies_before_move(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One move; then rank ``p["dying"]`` goes (``p["how"]``): ``killed`` (SIGKILL before the next move),
    ``killed_after_sizes`` (SIGKILL after the next move's size gather, so the others wait in the bytes'
    all-to-all) or ``stalls_after_sizes`` (alive, but never comes to the bytes). The others record what the
    next move raised."""
    exchange = live_exchange(p["timeout_s"])
    exchange.move([payload(0, rank, d) for d in range(world)], "move 0")
    where = "move 1"
    outgoing = [payload(3, rank, d) for d in range(world)]
    started = time.monotonic()
    if rank == p["dying"]:
        if p["how"] != "killed":
            sizes = np.array([0 if d == rank else len(b) for d, b in enumerate(outgoing)])
            exchange.all_gather(sizes, where)  # move's first half: the others go on to the bytes
        if p["how"] == "stalls_after_sizes":
            save_result({"type": "stalled"}, Path(p["tmp"]), rank)
            time.sleep(p["stall_s"])
            os._exit(0)
        time.sleep(0.5)  # the others are waiting in the move
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        exchange.move(outgoing, where)
    except Exception as err:
        return {**_record(err, started), "dead": exchange.dead}
    return {"type": None, "elapsed": time.monotonic() - started}


def time_moves(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """ms per move of ``p["bytes"]`` per rank (split evenly among the other ranks), after a few to warm up."""
    exchange = live_exchange(60.0)
    share = p["bytes"] // max(world - 1, 1)
    outgoing = [b"" if d == rank else os.urandom(share) for d in range(world)]
    for r in range(3):
        exchange.move(outgoing, f"warm-up {r}")
    started = time.perf_counter()
    for r in range(p["moves"]):
        exchange.move(outgoing, f"move {r}")
    per_move = (time.perf_counter() - started) / p["moves"]
    return {"ms": per_move * 1e3}
