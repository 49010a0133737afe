"""benchmarks.sync_count: the host-sync counter behind the async-path measurement."""

from __future__ import annotations

import threading

import pytest

from benchmarks.sync_count import count_syncs

torch = pytest.importorskip("torch")


def test_counts_host_copies_made_by_undercurrent_per_thread_and_restores_tensor():
    from undercurrent.probes.arrays import as_float_matrix

    rows = [torch.ones(3), torch.zeros(3)]
    original = torch.Tensor.tolist
    with count_syncs() as counts:
        as_float_matrix(rows)  # undercurrent: .to("cpu", float64) then .numpy()
        rows[0].tolist()  # this test's own call: not undercurrent's, not counted
        worker = threading.Thread(target=as_float_matrix, args=(rows,))
        worker.start()
        worker.join()
    assert torch.Tensor.tolist is original
    by_key = {(kind, who, call): n for (kind, who, call, _where), n in counts.items()}
    assert by_key == {
        ("generation thread", "undercurrent", "to('cpu')"): 1,
        ("generation thread", "undercurrent", "numpy"): 1,
        ("worker thread", "undercurrent", "to('cpu')"): 1,
        ("worker thread", "undercurrent", "numpy"): 1,
    }
    assert all(where.startswith("probes/arrays.py:") for (*_, where) in counts)
