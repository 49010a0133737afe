"""The flat-batch row mapping, on crafted step data: prefill, chunked prefill, decode,
mixed steps, padding, and batch slots reused by a new request."""

from __future__ import annotations

import pytest

from undercurrent.adapters.vllm.rows import TokenWindow, engine_request_id, step_windows


def _rows(windows: list[TokenWindow]) -> list[tuple[str, int]]:
    """(request, token index) for every row, in row order."""
    out: list[tuple[str, int]] = []
    for window in windows:
        for row in range(window.row_start, window.row_stop):
            out.append((window.request_id, window.token_start + row - window.row_start))
    return out


def test_whole_prompt_prefill_maps_rows_to_token_indices_from_zero():
    windows = step_windows(["a-x"], [0], [0, 4])
    assert _rows(windows) == [("a-x", 0), ("a-x", 1), ("a-x", 2), ("a-x", 3)]


def test_chunked_prefill_continues_where_the_cache_ends():
    # Step 1 ran tokens 0..5 of a 9-token prompt; step 2 runs 6..8 beside b's prefill.
    first = step_windows(["a-x"], [0], [0, 6])
    second = step_windows(["a-x", "b-y"], [6, 0], [0, 3, 5])
    assert _rows(first) == [("a-x", t) for t in range(6)]
    assert _rows(second) == [("a-x", 6), ("a-x", 7), ("a-x", 8), ("b-y", 0), ("b-y", 1)]


def test_decode_step_gives_one_row_per_request_at_its_own_length():
    windows = step_windows(["a-x", "b-y", "c-z"], [9, 3, 17], [0, 1, 2, 3])
    assert _rows(windows) == [("a-x", 9), ("b-y", 3), ("c-z", 17)]


def test_mixed_step_of_decodes_and_a_prefill_chunk():
    windows = step_windows(["a-x", "b-y", "c-z"], [12, 4, 0], [0, 1, 2, 6])
    assert _rows(windows) == [("a-x", 12), ("b-y", 4), ("c-z", 0), ("c-z", 1), ("c-z", 2),
                              ("c-z", 3)]
    assert windows[2].row_of(2) == 4
    assert windows[2].slot == 2


def test_reused_slot_maps_to_the_new_request():
    before = step_windows(["a-x", "b-y"], [5, 7], [0, 1, 2])
    # a finished; its slot 0 now holds c (a fresh prompt of 3 tokens).
    after = step_windows(["c-z", "b-y"], [0, 8], [0, 3, 4])
    assert _rows(before) == [("a-x", 5), ("b-y", 7)]
    assert _rows(after) == [("c-z", 0), ("c-z", 1), ("c-z", 2), ("b-y", 8)]


def test_requests_with_nothing_scheduled_and_empty_slots_are_skipped():
    windows = step_windows(["a-x", None, "c-z"], [3, 0, 4], [0, 1, 1, 2])
    assert [w.request_id for w in windows] == ["a-x", "c-z"]
    assert _rows(windows) == [("a-x", 3), ("c-z", 4)]


def test_padding_rows_past_the_last_request_belong_to_nobody():
    # query_start_loc is padded to be non-decreasing; only num_reqs slots are live.
    windows = step_windows(["a-x", "b-y", "stale"], [2, 0, 9], [0, 1, 3, 3, 3], num_reqs=2)
    assert _rows(windows) == [("a-x", 2), ("b-y", 0), ("b-y", 1)]


def test_every_row_is_mapped_once_and_in_order():
    req_ids = [f"r{i}-q" for i in range(6)]
    computed = [0, 5, 11, 2, 0, 40]
    counts = [7, 1, 1, 3, 2, 1]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    rows = _rows(step_windows(req_ids, computed, starts))
    assert len(rows) == sum(counts)
    expected = [(req_ids[i], computed[i] + k) for i in range(6) for k in range(counts[i])]
    assert rows == expected


def test_row_of_rejects_a_token_outside_the_window():
    (window,) = step_windows(["a-x"], [4], [0, 2])
    assert window.row_of(5) == 1
    with pytest.raises(IndexError, match="token 6 of 'a-x' is not in this step"):
        window.row_of(6)


def test_short_query_start_loc_is_a_clear_error():
    with pytest.raises(ValueError, match="needs num_reqs \\+ 1 = 3"):
        step_windows(["a", "b"], [0, 0], [0, 1])


def test_engine_request_id_strips_vllms_random_suffix():
    assert engine_request_id("uc12-9f8e7d6c") == "uc12"
    assert engine_request_id("uc12") == "uc12"
