"""Benchmarks: each file runs on its own (`python benchmarks/<file>.py`); tests import a few."""
