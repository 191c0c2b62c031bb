"""The model runner: one forward pass over a ragged batch against the paged KV cache, its public interface
(interface.py), and the CPU kernels that make it batch-invariant and bandwidth-bound (kernels.c, built and loaded
by kernels.py, driven by kernel_forward.py)."""
