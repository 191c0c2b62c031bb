"""Model execution inside a worker: the ragged forward over the paged KV cache, and the model layers it runs
(weight-only int4, tensor-parallel sharding). No process loop and no sockets here."""
