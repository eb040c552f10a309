"""The hang line names the ranks that did not join."""
from __future__ import annotations


def test_the_line_names_every_rank_that_did_not_join_and_ranges_of_the_ones_that_waited():
    from train.parallel import hang

    hang.PEERS[:] = [hang.Peer(f"n{r // 2}", None) for r in range(8)]
    try:
        waiting = {"op": "all_reduce", "seq": 1234, "in_collective": True}
        states = {r: {"rank": r, **waiting} for r in (0, 1, 2, 4, 5, 6, 7)}
        states[3] = {"rank": 3, "op": "all_reduce", "seq": 1233, "in_collective": False,
                     "where": "data.py:212 __iter__ (batch = next(it))"}
        assert hang.compose(states, "all_reduce", 1234, 8, 600) == (
            "rank 3 on n1 did not join all_reduce #1234 (ranks 0-2, 4-7 waited 600 s); rank 3 was in data.py:212 "
            "__iter__ (batch = next(it))")
        states[3], states[6] = None, {"rank": 6, "op": "broadcast", "seq": 1235, "in_collective": True}
        assert hang.compose(states, "all_reduce", 1234, 8, 600) == (
            "rank 3 on n1 and rank 6 on n3 did not join all_reduce #1234 (ranks 0-2, 4-5, 7 waited 600 s); rank 3 "
            "did not answer (stopped or frozen); rank 6 was waiting in broadcast #1235")
    finally:
        hang.PEERS.clear()
