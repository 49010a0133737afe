"""``benchmarks.collector``: the garbage collector's work per generation."""

from __future__ import annotations

import gc

import pytest

from benchmarks.collector import count_collections, main


def test_objects_alive_through_second_generation_collections_are_counted_as_moved():
    kept: list[list[int]] = []

    def generate() -> None:  # (a "generation" holding 12 x 700 lists until it ends)
        alive = [[index] for index in range(12 * 700)]
        kept.append(alive[:1])
        del alive

    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        found = count_collections(generate, 3)
    finally:
        gc.set_threshold(*threshold)
    each = found.per_generation()
    assert sum(found.young) >= 3 * 11 and found.young[1] >= 2  # (each 11th is a second)
    assert found.moved > 0  # (what was alive at each second-generation collection)
    assert 0 < found.full_every < float("inf") and each["full_ms_per_generation"] > 0
    assert found.held > 0 and found.full_s > 0


def test_nothing_alive_moves_nothing_and_no_full_collection_is_due():
    found = count_collections(lambda: None, 5)
    assert found.moved == 0 and found.full_every == float("inf")
    assert found.per_generation()["full_ms_per_generation"] == 0


@pytest.mark.parametrize("freeze", [False, True])
def test_the_command_prints_the_counts_per_generation(capsys, freeze):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    argv = ["--batch", "2", "--generations", "2", "--max-new-tokens", "3", "--layers", "3"]
    assert main(argv + (["--freeze"] if freeze else [])) == 0
    printed = capsys.readouterr().out
    assert "uc_inline_linear, batch 2, 3 layers, 2 generations" in printed
    assert "objects moved to the oldest" in printed and "ms per generation" in printed
    assert ("gc.freeze() first" in printed) is freeze
    assert gc.get_freeze_count() == 0  # (unfrozen again)
