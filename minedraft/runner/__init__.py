"""Running a model inside a worker: the ragged forward over the paged KV cache (model_runner.py), its public
interface (interface.py), the CPU kernels that make it batch-invariant and bandwidth-bound (kernels.c, built and
loaded by kernels.py, driven by kernel_forward.py), the model layers it runs (weight-only int4, tensor-parallel
sharding), and llama.cpp for GGUF files behind the same interface (llama_cpp.py, gguf.py). No process loop and no
sockets here."""
