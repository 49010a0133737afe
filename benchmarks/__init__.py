"""Overhead and throughput benchmarks for undercurrent.

Run ``python -m benchmarks.run`` (or ``make bench``) for the full table and
``python -m benchmarks.run --quick`` for the CI smoke mode. See
``docs/benchmarks.md`` for what is measured and how.
"""
