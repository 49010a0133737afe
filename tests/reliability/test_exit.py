"""A script that ends without closing its router: the async workers (daemon
threads) still judging then finish before the interpreter finalises, instead of
being stopped wherever they next take the interpreter lock (inside torch's
freeing of a tensor, that aborted the process: "terminate called without an
active exception", about one run in four of the shipped SAE spec at batch 64).

The worker's probe waits, in the middle of its call, until the script's main
thread has finished, holding torch tensors; it then lets go of them and writes a
mark. The process must exit cleanly with the mark written: the call was finished,
not cut off."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent('''
    import sys
    import threading

    import torch

    from undercurrent.probes import Probe
    from undercurrent.records import ActivationRecord
    from undercurrent.router import Router
    from undercurrent.spec.types import ExtractionPoint

    MARK = sys.argv[1]
    started = threading.Event()


    class Lingering(Probe):
        """Judges its rows once the main thread has ended, holding tensors."""

        probe_kind = "trajectory"

        def on_activation(self, record):
            held = [torch.zeros(256) for _ in range(64)]
            started.set()
            threading.main_thread().join()  # (the script has ended)
            del held  # (freed here: each tensor's free takes the lock again)
            with open(MARK, "w") as out:
                out.write("finished")
            return None


    point = ExtractionPoint(name="p", layers=(0,), tensor_type="residual_stream",
                            position="generated[*]", probe_type="lingering",
                            probe_kind="trajectory", execution_mode="async", queue_depth=4)
    router = Router(probes={"lingering": Lingering})
    router.register_request("r", [point])
    router.route(ActivationRecord(
        request_id="r", extraction_point_name="p", layer=0, tensor_type="residual_stream",
        token_index=3, is_generated=True, generated_index=0, token_id=1,
        tensor=torch.ones(8)))
    started.wait()
    # (the script ends here: the router is not closed, the worker is mid-call)
''')


def test_a_script_that_ends_without_closing_its_router_exits_cleanly(tmp_path):
    mark = tmp_path / "mark"
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    completed = subprocess.run([sys.executable, str(script), str(mark)], capture_output=True,
                               text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "terminate called" not in completed.stderr
    assert mark.read_text() == "finished"


HELD_STREAM = textwrap.dedent('''
    import sys
    import threading

    import torch

    from undercurrent import ProbedModel
    from undercurrent.probes import Probe
    from undercurrent.spec.types import ExtractionPoint

    MARK = sys.argv[1]
    reached = threading.Event()


    class WaitsForTheEnd(Probe):
        """At the third generated token, waits until the script has ended."""

        probe_kind = "trajectory"

        def on_activation(self, record):
            if record.generated_index == 2:
                reached.set()
                threading.main_thread().join()  # (the script has ended)
                held = [torch.zeros(256) for _ in range(64)]
                del held
                with open(MARK, "w") as out:
                    out.write("went on")
            return None


    point = ExtractionPoint(name="p", layers=(0, 1), tensor_type="residual_stream",
                            position="generated[*]", probe_type="waits",
                            probe_kind="trajectory")
    model = ProbedModel.from_pretrained("undercurrent/tiny", spec=[point],
                                        probes={"waits": WaitsForTheEnd})
    stream = model.stream("user : how do i bake bread ? assistant :", max_new_tokens=40)
    next(stream)
    reached.wait()
    # (the script ends here: the stream is held open, its generation mid-way)
''')


def test_a_script_that_ends_holding_an_open_stream_exits_cleanly(tmp_path):
    # The stream's generation (a daemon thread) is cancelled and waited for at exit,
    # instead of being stopped inside torch while the interpreter finalises.
    mark = tmp_path / "mark"
    script = tmp_path / "held_stream.py"
    script.write_text(HELD_STREAM)
    completed = subprocess.run([sys.executable, str(script), str(mark)], capture_output=True,
                               text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "terminate called" not in completed.stderr
    assert mark.read_text() == "went on"
