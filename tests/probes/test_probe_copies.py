"""What the router asks of a probe when it binds a call's requests at once: the
other requests' probes (``copies_for_requests``, one ``copy_for_request`` each)
and each request's context at the point (``RequestContext.each_at_point``).
The oracles are the one-at-a-time methods they stand for."""

from __future__ import annotations

import pytest

from undercurrent.probes import (
    CaptureProbe,
    LinearProbe,
    MeanProbe,
    NormProbe,
    Probe,
    RequestContext,
    TrajectoryProbe,
)
from undercurrent.probes.base import shallow_copies, shallow_copy
from undercurrent.spec.types import ExtractionPoint

POINT = ExtractionPoint(name="p", layers=(0,), tensor_type="residual_stream",
                        position="generated[*]", probe_type="linear_probe",
                        probe_kind="single_shot")


@pytest.mark.parametrize("make", [
    lambda: LinearProbe(weight=[1.0, 2.0], bias=0.5, threshold=1.0),
    lambda: NormProbe(threshold=2.0), MeanProbe, CaptureProbe,
    lambda: TrajectoryProbe(source="norm", alpha=0.5),
])
def test_the_built_ins_copies_are_what_copy_for_request_makes(make):
    probe = make()
    copies = probe.copies_for_requests(3)
    one = probe.copy_for_request()
    assert [type(copy) for copy in copies] == [type(probe)] * 3
    assert all(vars(copy) == vars(one) for copy in copies)
    assert len({id(copy) for copy in [probe, *copies]}) == 4
    assert shallow_copies(probe, 0) == []


def test_a_subclass_is_asked_for_each_copy_its_own_way():
    made: list[int] = []

    class Counted(LinearProbe):
        def copy_for_request(self):
            made.append(1)
            return None if len(made) == 2 else shallow_copy(self)

    probe = Counted(weight=[1.0], bias=0.0)
    copies = probe.copies_for_requests(3)
    assert made == [1, 1, 1] and copies[1] is None and type(copies[0]) is Counted

    class Plain(Probe):
        probe_kind = "single_shot"

    assert Plain().copies_for_requests(2) == [None, None]


def test_contexts_at_a_point_are_what_at_point_makes_of_each():
    contexts = [RequestContext(request_id="a", prompt="x", prompt_len=1, model_name="m",
                               prompt_token_ids=(4,)),
                RequestContext(request_id="b", metadata={"temperature": 0.5})]
    made = RequestContext.each_at_point(contexts, POINT)
    assert made == [ctx.at_point(POINT) for ctx in contexts]
    assert [list(vars(ctx)) for ctx in made] == [list(vars(ctx)) for ctx in contexts]
    assert all(ctx.extraction_point is POINT for ctx in made)
    assert contexts[0].extraction_point is None  # (the originals unchanged)


def test_contexts_of_prompts_are_what_of_prompt_makes_of_each():
    made = RequestContext.each_of_prompt(["a", "b"], ["x", None], [1, None], "m", [(4,), None])
    expected = [RequestContext.of_prompt("a", "x", 1, "m", (4,)),
                RequestContext.of_prompt("b", None, None, "m", None)]
    assert made == expected == [RequestContext(request_id="a", prompt="x", prompt_len=1,
                                               model_name="m", prompt_token_ids=(4,)),
                                RequestContext(request_id="b", model_name="m")]
    assert [list(vars(ctx)) for ctx in made] == [list(vars(ctx)) for ctx in expected]
    with pytest.raises(ValueError):
        RequestContext.each_of_prompt(["a"], ["x", "y"], [1, 1], "m", [None, None])
