"""Maintainer tools that build the bundled tiny model (``undercurrent/models/tiny/``):
not part of the runtime package, never imported by it.

- ``python -m tools.tiny_model.train`` trains the model and writes its tokenizer;
- ``python -m tools.tiny_model.probe_fit`` fits and ships its linear probe.

Run them from the repository root.
"""
