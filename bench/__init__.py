"""Benchmarks: `python -m bench.<name>` (or `llmesh bench`); results land in bench/results/<name>.json."""
