"""The worker-to-driver wire and the driver's step server, without an engine: a fake
worker sends crafted step batches over the real socket and reads the replies."""

from __future__ import annotations

from multiprocessing.connection import Client

import numpy as np
import pytest

from undercurrent.adapters.session import CaptureSession
from undercurrent.adapters.vllm import wire
from undercurrent.adapters.vllm.backend import reads_prompt_tokens
from undercurrent.adapters.vllm.channel import StepServer
from undercurrent.records import BatchSignals, ProbeSignal, SignalAction
from undercurrent.spec.position import parse_position
from undercurrent.spec.types import ExtractionPoint

POSITIONS = ["prompt[-1]", "prompt[0]+2", "generated[3]", "generated[*]", "generated[2:]",
             "generated[1:9]", 5, "generated[0]-1", "prompt[-1]+1", "prompt[-3]+1"]


def _point(position, stride=1, name="p", tensor_type="residual_stream", layers=(0, 2)):
    continuous = parse_position(position).is_continuous
    return ExtractionPoint(name=name, layers=layers, tensor_type=tensor_type,
                           position=position, stride=stride if continuous else 1,
                           probe_type="norm_probe",
                           probe_kind="trajectory" if continuous else "single_shot")


@pytest.mark.parametrize("position", POSITIONS)
def test_point_survives_the_wire_with_the_same_matches(position):
    point = _point(position, stride=2)
    rebuilt = wire.point_from_wire(wire.point_to_wire(point))
    assert rebuilt.layers == point.layers and rebuilt.tensor_type == point.tensor_type
    for token in range(30):
        for prompt_len in (1, 4, 9):
            generated = token >= prompt_len
            assert rebuilt.matches(token, generated, prompt_len) == point.matches(
                token, generated, prompt_len)


def test_prompt_reading_points_are_the_ones_prefix_caching_would_break():
    reads = {str(p): reads_prompt_tokens(_point(p)) for p in POSITIONS}
    assert reads == {"prompt[-1]": True, "prompt[0]+2": True, "generated[3]": False,
                     "generated[*]": False, "generated[2:]": False, "generated[1:9]": False,
                     "5": True, "generated[0]-1": True,
                     # (prompt[-1]+1 is generated[0], whatever the prompt)
                     "prompt[-1]+1": False, "prompt[-3]+1": True}


def test_batch_round_trips_and_slices_rows_per_group():
    bank = np.arange(12, dtype=np.float32).reshape(6, 2)
    batch = wire.StepBatch(step=3, banks=[bank], requests=["uc1", "uc2"], groups=[
        wire.GroupRows(0, "residual_stream", 0, 0, 2),
        wire.GroupRows(2, "mlp_out", 0, 2, 4),
    ], tokens=[("uc1", 0, [7, 8])],
        matches=wire.match_array([(0, 0, 4, 1), (0, 0, 5, 1), (1, 1, 0, 1)]),
        match_rows=wire.row_array([0, 1, 3]))
    back = wire.decode(wire.encode(batch))
    assert isinstance(back, wire.StepBatch) and back.num_rows == 6
    np.testing.assert_array_equal(back.rows(back.groups[1]), bank[2:6])
    assert back.tokens == [("uc1", 0, [7, 8])] and back.requests == ["uc1", "uc2"]
    matches = back.matches
    assert matches.dtype == np.int64 and matches.shape == (3, len(wire.MATCH_COLUMNS))
    assert matches.flags.c_contiguous and back.match_rows.flags.c_contiguous
    np.testing.assert_array_equal(matches, [[0, 0, 4, 1], [0, 0, 5, 1], [1, 1, 0, 1]])
    np.testing.assert_array_equal(back.match_rows, [0, 1, 3])


def test_column_arrays_are_contiguous_int64_and_keep_an_empty_batch_shaped():
    assert wire.match_array([]).shape == (0, 4) and wire.row_array([]).shape == (0,)
    empty = wire.StepBatch(step=1)
    assert empty.matches.shape == (0, 4) and empty.match_rows.shape == (0,)
    strided = np.arange(16).reshape(4, 4)[::2]
    made = wire.match_array(strided)
    assert made.flags.c_contiguous and made.dtype == np.int64
    np.testing.assert_array_equal(made, strided)
    rows = wire.row_array(np.arange(8, dtype=np.int32)[::2])
    assert rows.flags.c_contiguous and rows.dtype == np.int64
    np.testing.assert_array_equal(rows, [0, 2, 4, 6])


def test_decode_refuses_a_foreign_protocol_version_and_foreign_objects():
    batch = wire.StepBatch(step=1, version=wire.PROTOCOL_VERSION + 1)
    with pytest.raises(RuntimeError, match="different undercurrent versions"):
        wire.decode(wire.encode(batch))
    import pickle

    with pytest.raises(TypeError, match="unexpected message"):
        wire.decode(pickle.dumps({"not": "a batch"}))


class _AbortOnGenerated:
    """A stand-in router: aborts a request at one generated index."""

    def __init__(self, request_id, generated_index):
        self.request_id, self.generated_index = request_id, generated_index
        self.routed = []

    def register_request(self, request_id, points, ctx):
        pass

    def route_columns(self, batch, spans=None):  # what CaptureSession calls
        return BatchSignals.from_signals([self.route(r) for r in batch.records()])

    def route(self, record):
        self.routed.append(record.key())
        if (record.request_id, record.generated_index) == (self.request_id,
                                                           self.generated_index):
            return ProbeSignal(action=SignalAction.ABORT, score=1.0)
        return None

    def end_request(self, request_id):
        return {}


def test_step_server_routes_rows_as_records_and_replies_with_aborts():
    point = _point("generated[*]", name="traj", layers=(1,))
    router = _AbortOnGenerated("b", 1)
    session = CaptureSession(router, [point], keep_records=True)
    a = session.open_request("a", "", [5, 6, 7])
    b = session.open_request("b", "", [9, 9])
    aborted_in_engine = []
    server = StepServer(aborted_in_engine.extend)
    try:
        server.begin(session)
        server.track("uc1", a)
        server.track("uc2", b)
        worker = Client(server.address, family="AF_UNIX", authkey=server.authkey)
        # One decode step: a feeds generated token 0 (id 11), b feeds generated 1 (id 22);
        # b's generated token 0 (id 21) was fed in an earlier step with nothing captured.
        bank = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
        batch = wire.StepBatch(step=1, banks=[bank], requests=["uc2", "uc1"], groups=[
            wire.GroupRows(1, "residual_stream", 0, 0, 2),
        ], tokens=[("uc1", 0, [11]), ("uc2", 0, [21, 22])],
            matches=wire.match_array([(1, 0, 3, 1), (0, 0, 3, 1)]),
            match_rows=wire.row_array([0, 1]))
        worker.send_bytes(wire.encode(batch))
        reply = wire.decode(worker.recv_bytes())
        assert isinstance(reply, wire.StepReply)
        assert reply.aborted == ["uc2"] and aborted_in_engine == ["uc2"]
        assert [(r.request_id, r.token_index, r.token_id, r.generated_index) for r in
                a.records + b.records] == [("a", 3, 11, 0), ("b", 3, 22, 1)]
        np.testing.assert_array_equal(b.records[0].tensor, bank[1])
        assert b.abort is not None and b.abort.generated_index == 1 and a.live
        # A later batch for the aborted request is not routed any more.
        worker.send_bytes(wire.encode(wire.StepBatch(
            step=2, banks=[bank[:1]], requests=["uc2"],
            groups=[wire.GroupRows(1, "residual_stream", 0, 0, 1)],
            matches=wire.match_array([(0, 0, 4, 1)]), match_rows=wire.row_array([0]))))
        assert wire.decode(worker.recv_bytes()).aborted == []
        assert len(router.routed) == 2
        worker.close()
    finally:
        server.close()
    assert server.take_error() is None


def test_step_server_reports_a_routing_failure_on_the_main_thread_and_keeps_serving():
    class Broken(_AbortOnGenerated):
        def route(self, record):
            raise KeyError("boom")

    point = _point("generated[*]", name="traj", layers=(1,))
    session = CaptureSession(Broken("x", 0), [point])
    state = session.open_request("a", "", [1, 2])
    server = StepServer(lambda ids: None)
    try:
        server.begin(session)
        server.track("uc1", state)
        worker = Client(server.address, family="AF_UNIX", authkey=server.authkey)
        batch = wire.StepBatch(step=1, banks=[np.zeros((1, 2), np.float32)], requests=["uc1"],
                               groups=[wire.GroupRows(1, "residual_stream", 0, 0, 1)],
                               tokens=[("uc1", 0, [3])], matches=wire.match_array([(0, 0, 2, 1)]),
                               match_rows=wire.row_array([0]))
        worker.send_bytes(wire.encode(batch))
        assert wire.decode(worker.recv_bytes()).aborted == []
        error = server.take_error()
        assert isinstance(error, KeyError)
        worker.close()
    finally:
        server.close()


def test_a_worker_in_the_drivers_process_finds_the_server_and_is_answered_by_a_call(
        monkeypatch):
    from undercurrent.adapters.vllm import channel

    point = _point("generated[*]", name="traj", layers=(1,))
    router = _AbortOnGenerated("a", 0)
    session = CaptureSession(router, [point], keep_records=True)
    state = session.open_request("a", "", [5, 6, 7])
    aborted_in_engine = []
    server = StepServer(aborted_in_engine.extend)
    try:
        assert channel.local_server(server.address) is server
        assert channel.local_server(server.address + "-other") is None
        server.begin(session)
        server.track("uc1", state)
        bank = np.array([[1.0, 2.0]], dtype=np.float32)
        reply = server.answer(wire.StepBatch(
            step=1, banks=[bank], requests=["uc1"],
            groups=[wire.GroupRows(1, "residual_stream", 0, 0, 1)], tokens=[("uc1", 0, [11])],
            matches=wire.match_array([(0, 0, 3, 1)]), match_rows=wire.row_array([0])))
        assert reply.aborted == ["uc1"] == aborted_in_engine
        assert [(r.token_index, r.token_id) for r in state.records] == [(3, 11)]
        # a forked child's copy of the registry does not count
        real_pid = channel.os.getpid()
        monkeypatch.setattr(channel.os, "getpid", lambda: real_pid + 1)
        assert channel.local_server(server.address) is None
        monkeypatch.undo()
    finally:
        server.close()
    assert channel.local_server(server.address) is None
    assert server.take_error() is None


def test_a_repeated_steps_token_columns_give_each_record_its_token_and_aborts_are_new_ones():
    # Step 1 sends its tokens as lists, step 2 (a repeat) as columns; "b" is aborted
    # in step 1 and "a" in step 2: each reply names only the request aborted in it.
    point = _point("generated[*]", name="traj", layers=(1,))
    router = _AbortOnGenerated("b", 0)
    session = CaptureSession(router, [point], keep_records=True)
    a = session.open_request("a", "", [5, 6, 7])
    b = session.open_request("b", "", [8, 9, 9])
    c = session.open_request("c", "", [4, 4, 4])
    server = StepServer(lambda ids: None)
    bank = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
    groups = [wire.GroupRows(1, "residual_stream", 0, 0, 3)]
    try:
        server.begin(session)
        for engine_id, state in (("uc1", a), ("uc2", b), ("uc3", c)):
            server.track(engine_id, state)
        first = server.answer(wire.StepBatch(
            step=1, banks=[bank], requests=["uc1", "uc2", "uc3"], groups=groups,
            tokens=[("uc1", 0, [11]), ("uc2", 0, [21]), ("uc3", 0, [31])],
            matches=wire.match_array([(0, 0, 3, 1), (1, 0, 3, 1), (2, 0, 3, 1)]),
            match_rows=wire.row_array([0, 1, 2])))
        assert first.aborted == ["uc2"]
        router.request_id, router.generated_index = "a", 1
        second = server.answer(wire.StepBatch(
            step=2, banks=[bank[[0, 2]]], requests=["uc1", "uc3"],
            groups=[wire.GroupRows(1, "residual_stream", 0, 0, 2)],
            token_columns=(["uc1", "uc3"], np.array([1, 1]), np.array([12, 32])),
            matches=wire.match_array([(0, 0, 4, 1), (1, 0, 4, 1)]),
            match_rows=wire.row_array([0, 1])))
        assert second.aborted == ["uc1"]
        assert [(r.request_id, r.token_index, r.token_id) for r in a.records + c.records] == [
            ("a", 3, 11), ("a", 4, 12), ("c", 3, 31), ("c", 4, 32)]
        assert (a.generated, c.generated) == ([11, 12], [31, 32])
        assert [state.request_id for state in session.aborted] == ["b", "a"]
    finally:
        server.close()
    assert server.take_error() is None


def test_close_ends_the_server_s_thread_while_its_worker_is_connected_but_silent():
    # (an engine core that died mid-step, or is still shutting down: its worker's
    # connection stays open, and the thread reading it must still end)
    server = StepServer(lambda ids: None)
    worker = Client(server.address, family="AF_UNIX", authkey=server.authkey)
    try:
        worker.send_bytes(wire.encode(wire.StepBatch(step=1)))
        assert wire.decode(worker.recv_bytes()).aborted == []  # (the thread reads again)
        server.close()
        assert not server._thread.is_alive()
    finally:
        worker.close()
        server.close()


def test_a_server_never_closed_leaves_no_socket_folder_at_exit(tmp_path):
    import os
    import subprocess
    import sys

    script = ("from undercurrent.adapters.vllm.channel import StepServer\n"
              "server = StepServer(lambda ids: None)\n"
              "print(server.address)\n")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=120, check=False, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
