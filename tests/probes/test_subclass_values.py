"""A user's subclass of a built-in probe that computes other values (its own
``statistics`` or ``row_values``) or scores batches its own way (``on_batch``)
computes them itself: it is never handed the built-in's shared values, nor does
it hand its own to a built-in point on the same rows. The oracle is numpy on the
records the same call keeps (``records=True``), for several requests at once."""

from __future__ import annotations

from typing import Any

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from undercurrent import ProbedModel  # noqa: E402
from undercurrent.probes.linear import LinearProbe  # noqa: E402
from undercurrent.probes.statistics import NormProbe  # noqa: E402
from undercurrent.records import BatchSignals  # noqa: E402

PROMPTS = ["user : how do i bake bread ? assistant :",
           "user : i want to take someone's car so nobody finds out . assistant :",
           "user : what is a good name for a cat ? assistant :"]
HIDDEN = 128


class MaxAbsProbe(NormProbe):
    """Scores max |x| instead of the L2 norm (its own statistic)."""

    def statistics(self, matrix: Any) -> Any:
        return np.abs(matrix).max(axis=1)


class DoubledLinear(LinearProbe):
    """The readout's scores, doubled (its own row values)."""

    def row_values(self, batch: Any) -> Any:
        scores, meta = super().row_values(batch)
        return np.asarray(scores) * 2.0, meta


class HalfNorm(NormProbe):
    """Half the L2 norm, with a metadata column (its own on_batch)."""

    def on_batch(self, batch: Any) -> BatchSignals:
        rows = np.asarray(batch.tensor, dtype=np.float64).reshape(len(batch), -1)
        norms = np.linalg.norm(rows, axis=1) / 2.0
        return BatchSignals([0] * len(norms), norms.tolist(), all_scored=True,
                            metadata={"half": [True] * len(norms)})


WEIGHT = np.linspace(-1.0, 1.0, HIDDEN).tolist()
ORACLES = {
    "norm_probe": lambda x: np.linalg.norm(x),
    "max_abs": lambda x: np.abs(x).max(),
    "linear_probe": lambda x: 1.0 / (1.0 + np.exp(-(x @ np.asarray(WEIGHT) + 0.5))),
    "doubled": lambda x: 2.0 / (1.0 + np.exp(-(x @ np.asarray(WEIGHT) + 0.5))),
    "half_norm": lambda x: np.linalg.norm(x) / 2.0,
}


def _point(name: str, probe_type: str, mode: str) -> dict[str, Any]:
    args = {"weight": WEIGHT, "bias": 0.5} if probe_type in ("linear_probe", "doubled") else {}
    return {"name": name, "layers": [2, 3], "tensor_type": "residual_stream",
            "position": "generated[*]", "probe_type": probe_type, "probe_kind": "trajectory",
            "execution_mode": mode, "probe_args": args}


@pytest.mark.parametrize("mode", ["inline", "async"])
@pytest.mark.parametrize("types", [("norm_probe", "max_abs"), ("max_abs", "norm_probe"),
                                   ("linear_probe", "doubled"), ("doubled", "linear_probe"),
                                   ("norm_probe", "half_norm"), ("half_norm", "norm_probe")])
def test_a_subclass_with_values_of_its_own_scores_its_own_beside_the_built_in(types, mode):
    spec = {"version": "1", "extraction_points": [
        _point(probe_type, probe_type, mode) for probe_type in types]}
    probes = {"max_abs": MaxAbsProbe, "doubled": DoubledLinear, "half_norm": HalfNorm}
    with ProbedModel.from_pretrained("undercurrent/tiny", spec=spec, probes=probes) as pm:
        outputs = pm.generate(PROMPTS, max_new_tokens=6, records=True)
    for output in outputs:
        for name in types:
            records = [r for r in output.records if r.extraction_point_name == name]
            expected = [float(ORACLES[name](np.asarray(r.tensor, dtype=np.float64)))
                        for r in records]
            result = output.results[name]
            assert result.error is None, result.error
            got = [signal.score for signal in result.signals]
            np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=f"{name} {mode}")
            if name == "half_norm":
                assert all(s.metadata.get("half") is True for s in result.signals)
