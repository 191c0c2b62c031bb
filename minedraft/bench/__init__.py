"""Benchmarking: the `minedraft bench` comparison table (runner.py), its in-process baselines on all cores
(baselines.py), prompt sets (prompts.py), Chrome traces and timeline plots (trace.py)."""
