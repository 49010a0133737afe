"""A generation's plans are released when it ends (``StepPlan.release``): every
request's state, signals and captured rows are freed as soon as the caller
drops the outputs, by reference counting alone, not left in a reference cycle
(a plan and its groups; a request's signal log and the matches it keeps) until
the garbage collector next runs. The oracle is a weak reference to each
request's state, checked with the collector switched off; the outputs are read
first, so reading them after the release is covered too.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cycles import undercurrent_types_in_cycles  # noqa: E402
from hf_models import build_tokenizer, own_model  # noqa: E402

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.adapters import session as session_module  # noqa: E402
from undercurrent.spec import parse_dict  # noqa: E402

PROMPTS = ["the cat sat", "a dog ran far away", "one"]


def _spec(*points: dict[str, Any]) -> Any:
    return parse_dict({"version": "1", "extraction_points": list(points)})


def _point(name: str, **fields: Any) -> dict[str, Any]:
    point = {"name": name, "layers": [0, 1], "tensor_type": "residual_stream",
             "position": "generated[*]", "probe_type": "norm_probe",
             "probe_kind": "single_shot", "probe_args": {"threshold": 1.0e9}}
    point.update(fields)
    return point


@pytest.fixture
def states(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[weakref.ref[Any]]]:
    """Weak references to the request states every generation opens, with the
    garbage collector off for the test (what is freed is freed by counting)."""
    found: list[weakref.ref[Any]] = []
    original = session_module.CaptureSession.open_requests

    def recording(self: Any, entries: Any) -> Any:
        opened = original(self, entries)
        found.extend(weakref.ref(state) for state in opened)
        return opened

    monkeypatch.setattr(session_module.CaptureSession, "open_requests", recording)
    gc.collect()
    gc.disable()
    try:
        yield found
    finally:
        gc.enable()


CASES = {
    # one steady point: its decode steps routed in windows, signals kept as columns
    "window": (_spec(_point("norm")), {}),
    # two points: every step routed as it comes, each request's signals per step
    "per step": (_spec(_point("norm"), _point("mlp", layers=[2], tensor_type="mlp_out")),
                 {}),
    # the activations kept on the outputs, and one more forward for the last token
    "records": (_spec(_point("norm")), {"records": True, "capture_last_token": True}),
}


@pytest.mark.parametrize("read", [True, False], ids=["outputs read", "results only"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_generation_leaves_nothing_for_the_garbage_collector(case: str, read: bool,
                                                               states: list[Any]) -> None:
    spec, options = CASES[case]
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as model:
        outputs = model.generate(PROMPTS, max_new_tokens=6, **options)
        for output in outputs:
            assert output.results and all(result.stats.received > 0
                                          for result in output.results.values())
            if read:  # after the generation (its plans released): signals, records
                assert len(list(output.signals)) == sum(
                    result.stats.received for result in output.results.values())
                if options.get("records"):
                    assert len(output.records) == len(list(output.signals))
        assert len(states) == len(PROMPTS)
        del outputs, output
        assert [ref() for ref in states] == [None] * len(PROMPTS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_object_of_undercurrent_is_left_in_a_reference_cycle(case: str,
                                                                states: list[Any]) -> None:
    """Not only the requests' states: nothing undercurrent made (a decode step's
    repeated plan and its groups among them, one per step) is found by the
    collector once the outputs are dropped."""
    spec, options = CASES[case]
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec) as model:
        model.generate(PROMPTS, max_new_tokens=4, **options)  # (loading's own garbage)
        gc.collect()
        outputs = model.generate(PROMPTS, max_new_tokens=8, **options)
        assert all(output.results for output in outputs)
        del outputs
        assert undercurrent_types_in_cycles() == []


def test_a_model_dropped_without_close_stops_its_async_workers() -> None:
    """A ProbedModel dropped without close() (a notebook cell that builds a new
    one, run again) lets its router's async workers and their supervisor end,
    and leaves no hook on the wrapped model: nothing of it runs on."""
    model = own_model("llama")
    spec = _spec(_point("norm", probe_kind="trajectory", execution_mode="async"))
    threads: list[threading.Thread] = []
    schedulers = []
    for _ in range(3):
        probed = ProbedModel(model, build_tokenizer(), spec=spec)
        outputs = probed.generate(["w1 w2 w3"], max_new_tokens=3)
        assert "norm" in outputs[0].results  # (the async point ran)
        scheduler = probed.router._scheduler
        threads += [worker.thread for worker in scheduler._workers]
        threads.append(scheduler._supervisor)
        schedulers.append(scheduler)
        del probed, outputs
    gc.collect()
    assert len(threads) == 9
    assert [scheduler._stopping for scheduler in schedulers] == [True] * 3
    for thread in threads:  # (a stopping scheduler's threads end once its line is empty)
        thread.join()
    hooks = sum(len(module._forward_hooks) + len(module._forward_pre_hooks)
                for module in model.modules())
    assert hooks == 0
