"""The caller's process: the Engine (worker life-cycle and the public API), the asyncio scheduler (two batches,
admission, abort, failure fan-out), per-request state, detokenization, chat templates, step statistics, and the
in-process baselines (target alone, sequential SD) the benchmark compares against."""
