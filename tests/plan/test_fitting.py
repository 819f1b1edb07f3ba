"""The rank fit's decisions (odb.plan.ranks.fitting) on literal arrays, computed by hand."""

import numpy as np

from odb.plan.ranks.fitting import (SplitDecision, WindowDecision, cost_rank_order, decide_splits, decide_trim,
                              decide_window, must_emit)


# ---- the window's step count ------------------------------------------------------------

def test_equal_ranks_run_their_own_count():
    assert decide_window([4, 4, 4], [0, 0, 0], [False] * 3, join=True) == WindowDecision(4, False, False)


def test_before_any_data_ends_the_smallest_count_wins():
    assert decide_window([5, 3], [0, 0], [False, False], join=True).steps == 3


def test_a_rank_that_cannot_defer_raises_the_count():
    assert decide_window([5, 3], [4, 0], [False, False], join=True).steps == 4


def test_once_a_rank_is_short_of_data_the_largest_count_wins_and_all_done_waits_for_every_rank():
    assert decide_window([5, 1], [0, 0], [False, True], join=True) == WindowDecision(5, False, False)
    assert decide_window([2, 1], [0, 0], [True, True], join=True) == WindowDecision(2, False, True)


def test_join_false_goes_local_once_a_rank_ends():
    assert decide_window([5, 1], [0, 0], [False, True], join=False) == WindowDecision(0, True, False)
    assert decide_window([5, 1], [0, 0], [False, False], join=False).go_local is False


# ---- groups a rank cannot defer ---------------------------------------------------------

def test_must_emit_defers_cheapest_first_until_the_carry_room_is_used():
    # costs 30, 10, 20 with 3, 1, 2 samples: room 3 takes the 10 (1) and the 20 (2), not the 30.
    assert must_emit([30, 10, 20], [3, 1, 2], [0, 0, 0], room=3, room_tokens=None) == 1
    assert must_emit([30, 10, 20], [3, 1, 2], [0, 0, 0], room=6, room_tokens=None) == 0
    assert must_emit([30, 10, 20], [3, 1, 2], [0, 0, 0], room=0, room_tokens=None) == 3


def test_must_emit_stops_at_the_first_group_that_does_not_fit():
    # The cheapest group (cost 5) has 4 samples: with room 3 nothing can be deferred, even the others.
    assert must_emit([5, 10], [4, 1], [0, 0], room=3, room_tokens=None) == 2


def test_must_emit_counts_real_tokens_when_windows_close_at_a_token_count():
    assert must_emit([30, 10, 20], [3, 1, 2], [30, 10, 20], room=10, room_tokens=15) == 2
    assert must_emit([30, 10, 20], [3, 1, 2], [30, 10, 20], room=10, room_tokens=30) == 1


# ---- stage 1: defer or rebalance --------------------------------------------------------

def test_a_rank_with_the_step_count_keeps_everything():
    t = decide_trim([4, 2, 3], 3, planned_final=False)
    assert (t.keep.tolist(), t.defer.tolist(), t.rebalance) == ([0, 1, 2], [], False)


def test_deferral_puts_back_the_least_costly_groups():
    t = decide_trim([5, 9, 1, 7], 2, planned_final=False)
    assert (t.keep.tolist(), t.defer.tolist()) == ([1, 3], [0, 2])


def test_deferral_ties_keep_the_earlier_group():
    t = decide_trim([3, 3, 3], 1, planned_final=False)
    assert (t.keep.tolist(), t.defer.tolist()) == ([2], [0, 1])


def test_the_last_window_of_a_short_rank_is_rebalanced_other_windows_are_not():
    assert decide_trim([8, 2], 4, planned_final=True).rebalance is True
    assert decide_trim([8, 2], 4, planned_final=False).rebalance is False
    assert decide_trim([], 4, planned_final=True).rebalance is False  # nothing to re-cut
    assert decide_trim([8, 2], 2, planned_final=True).rebalance is False


# ---- stage 2: split, then ghosts ---------------------------------------------------------

def test_no_split_when_the_count_is_met():
    assert decide_splits([3, 2], 2) == SplitDecision(((0, 0, 3), (1, 0, 2)), 0, 0)


def test_split_halves_the_largest_group_the_first_half_taking_the_odd_sample():
    d = decide_splits([2, 5], 3)
    assert d.pieces == ((0, 0, 2), (1, 0, 3), (1, 3, 5)) and (d.ghosts, d.splits) == (0, 1)


def test_split_goes_on_over_the_halves():
    d = decide_splits([4], 4)
    assert sorted(b - a for _, a, b in d.pieces) == [1, 1, 1, 1] and (d.ghosts, d.splits) == (0, 3)
    groups = d.apply([np.array([10, 11, 12, 13])])
    assert sorted(int(g[0]) for g in groups) == [10, 11, 12, 13]


def test_one_rank_short_gets_ghosts_once_nothing_splits():
    d = decide_splits([1, 1], 4)
    assert (d.ghosts, d.splits) == (2, 0)
    assert [None if g is None else g.tolist() for g in d.apply([np.array([7]), np.array([8])])] == [[7], [8], None,
                                                                                                    None]


def test_a_rank_with_nothing_runs_only_ghosts():
    d = decide_splits([], 3)
    assert d == SplitDecision((), 3, 0) and d.apply([]) == [None, None, None]


def test_carry_groups_count_toward_the_steps_before_any_split():
    # stage 1 kept one group and 2 came from the carry (their sizes follow): 3 groups, 3 steps, no split.
    assert decide_splits([4, 2, 2], 3).splits == 0


# ---- cost ranking ------------------------------------------------------------------------

def test_cost_rank_order_is_decreasing_cost_ties_by_position():
    assert cost_rank_order([10, 30, 20, 30]).tolist() == [1, 3, 2, 0]


def test_cost_rank_order_with_the_probe_puts_the_longest_sample_first():
    assert cost_rank_order([10, 30, 20], longest=[9, 5, 9]).tolist() == [2, 0, 1]
    assert cost_rank_order([]).tolist() == []
