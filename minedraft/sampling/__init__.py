"""Speculative-sampling maths, free of I/O and processes: the batched lossless sampler and its per-row reference,
counter-based random numbers, Tetris draft selection, and the logprobs of emitted tokens."""
