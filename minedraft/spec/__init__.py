"""Speculative-decoding maths, free of I/O and processes: the batched lossless sampler and its per-row reference,
counter-based random numbers, Tetris draft selection, and dynamic speculation (the per-step draft budget)."""
