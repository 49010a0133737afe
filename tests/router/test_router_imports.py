"""The router and probe registry never import torch; the router runs without numpy."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_router_routes_plain_lists_without_importing_numpy_or_torch():
    code = textwrap.dedent("""
        import sys
        from undercurrent.probes import probe
        from undercurrent.records import ActivationRecord
        from undercurrent.router import Router
        from undercurrent.spec.types import ExtractionPoint

        @probe
        def first(record):
            return record.tensor[0]

        point = ExtractionPoint(name="p", layers=(0,), tensor_type="mlp_out",
                                position="generated[*]", probe_type="first",
                                probe_kind="single_shot")
        with Router() as router:
            router.register_request("r", [point])
            signal = router.route(ActivationRecord("r", "p", 0, "mlp_out", 0, True, 0, 1, [2.5]))
            assert signal.score == 2.5
            assert router.end_request("r")["p"].verdict["max_score"] == 2.5
        loaded = sorted(m for m in ("numpy", "torch", "transformers", "vllm") if m in sys.modules)
        print(loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
