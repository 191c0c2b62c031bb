"""Model execution inside a worker: the ragged forward over the paged KV cache, and the model layers it runs
(weight-only int4, tensor-parallel sharding); and llama.cpp for GGUF files behind the same interface (llama_cpp.py,
gguf.py). No process loop and no sockets here."""
