"""The vLLM backend: live probing inside a vLLM engine under continuous batching.

- :mod:`.rows` maps each row of a step's flat token batch to (request, token index)
  (pure, no vLLM import);
- :mod:`.wire` is what crosses from the worker to the driver: one compact message per
  engine step, and the driver's reply;
- :mod:`.layout` locates decoder layers, attention/MLP blocks and the final norm on
  vLLM's native models;
- :mod:`.worker` is the worker extension (``worker_extension_cls``) that installs the
  hooks and gathers each step's matching rows;
- :mod:`.backend` drives the engine and routes records on the driver;
- :mod:`.spawning` refuses an engine whose processes would import an unguarded
  script again;
- :mod:`.config_capabilities` says what an engine would capture, from a config alone
  (``undercurrent inspect-model``).

Importing this package does not import torch or vllm.
"""

from __future__ import annotations

from undercurrent.adapters.vllm.config_capabilities import capabilities_from_config

WORKER_EXTENSION = "undercurrent.adapters.vllm.worker.UndercurrentWorkerExtension"
"""Qualified name passed to vLLM as ``worker_extension_cls``."""

SUPPORTED_VLLM = (">=0.32", "<0.34")
"""vLLM versions this adapter is written and tested against."""

__all__ = ["SUPPORTED_VLLM", "WORKER_EXTENSION", "capabilities_from_config"]
