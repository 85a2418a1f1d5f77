"""The one greedy decoder: lock-step and early-exit decoding give the same tokens."""

import torch

from zcvae.model.decoding import greedy_decode


def _count_up(V: int):
    def next_logits(ids_RL, mask_RL):
        # next token = last attended token + 1 (mod V)
        last_R = mask_RL.sum(1) - 1
        prev_R = ids_RL[torch.arange(ids_RL.shape[0]), last_R]
        return torch.nn.functional.one_hot((prev_R + 1) % V, V).float()

    return next_logits


def test_lock_step_and_early_exit_give_the_same_tokens_with_several_stop_ids():
    V, pad = 12, 0
    prompts = [[3], [7, 7], [9]]
    kw = dict(num_steps=10, stop_id=(8, 11), pad_id=pad)
    locked = greedy_decode(_count_up(V), prompts, lock_step=True, **kw)
    early = greedy_decode(_count_up(V), prompts, lock_step=False, **kw)
    assert locked[:2] == early[:2] == ([[4, 5, 6, 7], [], [10]], [True, True, True])
    assert locked[2] == 10 and early[2] == 5  # early exit once the slowest row (3 -> ... -> 8) stopped


def test_rows_that_never_stop_run_for_num_steps():
    generated, closed, forwards = greedy_decode(_count_up(100), [[1]], num_steps=3, stop_id=99, pad_id=0, lock_step=False)
    assert (generated, closed, forwards) == ([[2, 3, 4]], [False], 3)


def test_choose_next_replaces_the_argmax_and_sees_every_row():
    seen = []

    def two_ahead(logits_RV):
        seen.append(logits_RV.shape[0])
        return (logits_RV.argmax(-1) + 2) % logits_RV.shape[1]

    generated, closed, _ = greedy_decode(_count_up(10), [[1], [4]], num_steps=3, stop_id=9, pad_id=0,
                                         lock_step=False, choose_next=two_ahead)
    # the argmax would be last + 1; the pick is last + 3 (mod 10)
    assert generated == [[4, 7, 0], [7, 0, 3]] and closed == [False, False]
    assert seen == [2, 2, 2]  # one call per forward, on all rows


def test_lock_step_with_all_stopped_ends_when_every_rank_has_stopped():
    V, pad = 12, 0
    prompts = [[3], [7, 7], [9]]  # this rank's rows have all stopped after 5 forwards
    kw = dict(num_steps=10, stop_id=(8, 11), pad_id=pad, lock_step=True)
    calls = []

    def only_here(here):  # one rank: its rows are every rank's rows
        calls.append(here)
        return here

    alone = greedy_decode(_count_up(V), prompts, all_stopped=only_here, **kw)
    assert alone == ([[4, 5, 6, 7], [], [10]], [True, True, True], 5)
    assert calls == [False, False, False, False, True]  # once after each forward, none before the first

    rank_two_stops_after = 7  # another rank's slowest row: this rank keeps stepping with it, writing nothing

    def with_a_slower_rank(here):
        calls.append(here)
        return here and len(calls) >= rank_two_stops_after

    calls.clear()
    waiting = greedy_decode(_count_up(V), prompts, all_stopped=with_a_slower_rank, **kw)
    assert waiting == ([[4, 5, 6, 7], [], [10]], [True, True, True], rank_two_stops_after)
