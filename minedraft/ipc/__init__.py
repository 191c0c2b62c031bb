"""Transport between the scheduler and the worker processes: ZeroMQ sockets, msgpack control messages,
tensors out of band (shared memory on CPU, CUDA IPC on GPU)."""
