"""The llama.cpp runner: a GGUF model behind the same interface as the torch ModelRunner (forward, .cache,
vocab_size, device, dtype, hidden_size), through llama-cpp-python's low-level API. CPU only.

One llama context holds one **unified** KV cache (`kv_unified`): a pool of cells any sequence may use, sized from
the engine's block pool. What maps to what:

* a request (`rid`) -> a llama sequence id, taken from a free list at `allocate`;
* block tables and admission (`allocate`, `can_allocate`, `fits_ever`, `used_blocks`) -> counted as PagedKVCache
  counts them (the class is reused without tensors), so the scheduler's accounting is unchanged;
* a sequence's positions (`length`) -> its cells; `forward` appends at `length`;
* rollback of rejected drafts (`truncate`) -> `llama_memory_seq_rm(seq, new_length, -1)`;
* shared prefix blocks (`allocate(blocks, prompt, cached)`) -> `llama_memory_seq_cp(src, dst, 0, n)` from a live
  sequence that committed those blocks: the cells gain a second owner, nothing is copied or recomputed;
* committed blocks (`commit`, `frozen`) -> recorded by content key as in PagedKVCache, with the live sequences
  that hold them;
* `free` -> `llama_memory_seq_rm(seq, -1, -1)`; cells shared with another live sequence stay.

A prefix cached only by a request that has finished (its cells are gone) is recomputed: `allocate` returns how many
leading positions this worker really holds, which the interface allows. The cell pool is the block pool plus a
margin for that case (a prefix recomputed while another live sequence holds it); a decode that still finds no
room raises MemoryError.

Logits: a llama batch carries every row's new tokens with explicit positions and sequence ids, and marks the
last `num_logits` tokens of each row for output; llama.cpp returns those rows in batch order (float32).
Exactness: llama.cpp's CPU kernels depend on the shape of a ubatch (flash attention takes a tiled kernel for 64+
query rows; one-token ubatches take matrix-vector paths for float weights and a thread-split attention). This
runner sends ubatches of at most 63 tokens and never of one token (for float weights never with one output), so a
position's logits are bitwise those of decoding its sequence alone (measured: docs/BENCHMARKS.md "llama.cpp
runner"); what remains is where llama.cpp places a sequence's KV cells among others' with several requests in
flight.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from ..cache.paged_kv import PagedKVCache
from .gguf import import_llama_cpp

MAX_SEQS = 256          # llama.cpp's LLAMA_MAX_SEQ: sequence ids live in [0, 256)
SCRATCH_SEQ = MAX_SEQS - 1  # the padding token's sequence (see LlamaCppRunner.pad_float), never a request's
FLOAT_FILE_TYPES = {0, 1, 32}  # general.file_type of F32, F16 and BF16 GGUFs
N_BATCH = 2048          # tokens per llama_decode call (llama-server's default); longer forwards are split
# tokens per graph evaluation inside one call: below 64, llama.cpp's CPU flash attention takes its per-query-row
# kernel for every ubatch (64 or more query rows take a tiled kernel that rounds differently), so a position's
# attention does not depend on how many tokens share its batch (docs/BENCHMARKS.md "llama.cpp runner")
N_UBATCH = 63


class LlamaKVCache(PagedKVCache):
    """PagedKVCache's accounting (blocks, lengths, committed prefixes) over llama.cpp's cells: no tensors here,
    every change of a sequence's positions is mirrored into the llama context's memory."""

    def __init__(self, runner: "LlamaCppRunner", num_tokens: int, block_size: int):
        super().__init__(0, 1, 1, num_tokens, block_size)  # zero layers: bookkeeping only
        self._lib, self._mem = runner.lib, runner.memory
        self._free_ids = list(range(SCRATCH_SEQ - 1, -1, -1))
        self.llama_seq: dict[object, int] = {}
        self._holders: dict[bytes, set] = {}   # block key -> live sequences whose cells hold that prefix

    def allocate(self, seq_id, num_tokens: int, blocks=None, prompt=None, cached: int = 0, start=None) -> int:
        if not self._free_ids:
            raise MemoryError(f"llama.cpp holds at most {SCRATCH_SEQ} sequences at once")
        start = super().allocate(seq_id, num_tokens, blocks, prompt, cached, start)
        lid = self.llama_seq[seq_id] = self._free_ids.pop()
        self._lib.llama_memory_seq_rm(self._mem, lid, -1, -1)  # nothing left over from an earlier owner
        keys = self._keys[seq_id]
        # the longest shared prefix some live sequence holds (keys are chained: holding block j means 0..j)
        j = len(keys)
        while j and not (self._holders.get(keys[j - 1], set()) - {seq_id}):
            j -= 1
        del keys[j:]
        self._lengths[seq_id] = j * self.block_size
        if j:
            src = next(iter(self._holders[keys[j - 1]]))
            self._lib.llama_memory_seq_cp(self._mem, self.llama_seq[src], lid, 0, j * self.block_size)
            for k in keys:
                self._holders.setdefault(k, set()).add(seq_id)
        return j * self.block_size

    def commit(self, seq_id, tokens, upto: int) -> None:
        super().commit(seq_id, tokens, upto)
        for k in self._keys[seq_id]:
            self._holders.setdefault(k, set()).add(seq_id)

    def free(self, seq_id) -> None:
        if seq_id in self.llama_seq:
            for k in self._keys.get(seq_id, ()):
                held = self._holders.get(k)
                if held is not None:
                    held.discard(seq_id)
                    if not held:
                        del self._holders[k]
            lid = self.llama_seq.pop(seq_id)
            self._lib.llama_memory_seq_rm(self._mem, lid, -1, -1)
            self._free_ids.append(lid)
        super().free(seq_id)

    def truncate(self, seq_id, new_length: int) -> None:
        old = self._lengths[seq_id]
        super().truncate(seq_id, new_length)  # validates (never below shared or committed positions)
        if new_length < old and not self._lib.llama_memory_seq_rm(self._mem, self.llama_seq[seq_id], new_length, -1):
            raise RuntimeError(f"llama.cpp could not roll sequence {seq_id!r} back to {new_length}")

    def slots(self, *a, **k):  # pragma: no cover - torch-cache addressing has no meaning here
        raise NotImplementedError("the llama.cpp runner has no cache slots (feature-conditioned drafts need torch)")


class LlamaCppRunner:
    """A GGUF model through llama.cpp, with the torch ModelRunner's interface (see the module docstring)."""

    fc = None                # no feature-conditioned (EAGLE) drafts through llama.cpp
    state_store = None

    def __init__(self, path: str, kv_cache_tokens: int, block_size: int = 16, threads: int | None = None,
                 flash_attn: bool | None = None, kv_type: str = "f16", margin: float = 0.25, ubatch: int = N_UBATCH):
        """path: a GGUF file. threads: llama.cpp's threads (default: one per core this process may run on).
        flash_attn: None = llama.cpp's choice (auto, as llama-server). kv_type: 'f16' (llama.cpp's default) or
        'f32'. margin: extra cells over the block pool, for prefixes recomputed beside a live holder."""
        self.lib = lib = import_llama_cpp()
        self.path = path
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path!r} (not a GGUF model it supports)")
        buf = ctypes.create_string_buffer(32)
        n = lib.llama_model_meta_val_str(self.model, b"general.file_type", buf, len(buf))
        self.file_type = int(buf.value) if n > 0 and buf.value.isdigit() else None
        # A one-token ubatch takes other kernels than two or more: float weights are multiplied with ggml's
        # matrix-vector dot products instead of llamafile's sgemm tiles, and with several threads flash attention
        # over 512+ cells splits the cells between threads; both round differently. A padding token (its own
        # scratch sequence, no logits) keeps every ubatch at two or more tokens, so a position's logits do not
        # depend on what shares its batch. Quantized weights (Q4_1, ...) on one thread need none (measured).
        self.pad_float = self.file_type in FLOAT_FILE_TYPES
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = lib.llama_vocab_n_tokens(self.vocab)
        self.hidden_size = lib.llama_model_n_embd(self.model)
        if threads is None:
            from ..cores import threads_for
            threads = threads_for(sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
        self.threads = threads
        pool = max(1, kv_cache_tokens // block_size) * block_size
        cp = lib.llama_context_default_params()
        cp.n_ctx = int(pool * (1 + margin)) + N_BATCH
        cp.n_batch, cp.n_ubatch, cp.n_seq_max = N_BATCH, ubatch, MAX_SEQS
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        cp.no_perf = True
        if flash_attn is not None:
            cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        types = {"f16": lib.GGML_TYPE_F16, "f32": lib.GGML_TYPE_F32}
        cp.type_k = cp.type_v = types[kv_type]
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {cp.n_ctx} cells for {path!r}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.cache = LlamaKVCache(self, kv_cache_tokens, block_size)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._batch = _Batch(N_BATCH + 1)
        self.ubatch = ubatch
        self.draft_info = {"runner": "llama.cpp", "gguf": os.path.basename(path), "threads": threads,
                           "weight_bytes": os.path.getsize(path)}

    def set_threads(self, n: int) -> None:
        """The verifier lends itself the drafter's cores for plain steps (workers/plain_steps.py)."""
        if n != self.threads:
            self.lib.llama_set_n_threads(self.ctx, n, n)
            self.threads = n

    def keep_states(self) -> None:
        raise NotImplementedError("feature-conditioned drafts need the torch runner, not llama.cpp")

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def forward(self, seq_ids: list, token_lists: list[list[int]], num_logits: int = 1, features=None,
                hidden: bool = False, packed: bool = False):
        """Append token_lists[i] to sequence seq_ids[i]; logits [B, num_logits, V] of each row's last num_logits
        new tokens, right-aligned as the torch runner does (a row with n < num_logits new tokens repeats its first
        token's logits in its first num_logits - n places). packed=True: (rows [M, V], index [B, num_logits])."""
        if features is not None or hidden:
            raise NotImplementedError("feature-conditioned drafts and hidden states need the torch runner")
        if any(not t for t in token_lists):
            raise ValueError("each sequence needs at least one new token")
        cache = self.cache
        lens = [len(t) for t in token_lists]
        starts = [cache.length(s) for s in seq_ids]
        for s, st, n in zip(seq_ids, starts, lens):
            if st + n > cache._capacity[s]:
                raise MemoryError(f"sequence {s!r} needs {st + n} positions, reserved {cache._capacity[s]}")
        index = torch.empty(len(seq_ids), num_logits, dtype=torch.long)
        tokens, pos, seqs, want = [], [], [], []
        m = 0
        for b, (sid, toks, st, n) in enumerate(zip(seq_ids, token_lists, starts, lens)):
            out = min(n, num_logits)
            tokens += toks
            pos += range(st, st + n)
            seqs += [cache.llama_seq[sid]] * n
            want += [0] * (n - out) + [1] * out
            index[b] = torch.arange(m - (num_logits - out), m + out).clamp(min=m)
            m += out
        rows = torch.from_numpy(self._decode(tokens, pos, seqs, want, m))
        for sid, n in zip(seq_ids, lens):
            cache.extend(sid, n)
        if packed:
            return rows, index
        return rows.index_select(0, index.reshape(-1)).view(len(seq_ids), num_logits, -1)

    def _decode(self, tokens, pos, seqs, want, n_out: int) -> np.ndarray:
        """llama_decode over the tokens in calls of at most N_BATCH; the logits of the marked ones [n_out, V]."""
        out = np.empty((n_out, self.vocab_size), dtype=np.float32)
        done = got = 0
        while done < len(tokens):
            n = min(N_BATCH, len(tokens) - done)
            t, p, q, o = tokens[done:done + n], pos[done:done + n], seqs[done:done + n], want[done:done + n]
            keep = None
            if self.pad_float or self.threads > 1:
                t, p, q, o, keep = self._two_or_more(t, p, q, o)
            k = self._batch.fill(t, p, q, o)
            rc = self.lib.llama_decode(self.ctx, self._batch.struct)
            if len(t) > n:
                self.lib.llama_memory_seq_rm(self.memory, SCRATCH_SEQ, -1, -1)
            if rc == 1:
                raise MemoryError("llama.cpp's KV cache has no room for this batch")
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            if k:
                rows = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(k, self.vocab_size))
                if keep is not None:
                    rows = rows[keep]
                out[got:got + len(rows)] = rows
                got += len(rows)
            done += n
        return out

    def _two_or_more(self, t, p, q, o):
        """Make every ubatch hold two or more tokens and, for float weights, two or more outputs (llama.cpp runs
        the last layer's feed-forward and the LM head on the output rows only): a padding token in the scratch
        sequence for a last ubatch of one token, an extra output for a ubatch with one. Returns the lists and
        which output rows are the caller's (a bool array over the outputs)."""
        t, p, q, o = list(t), list(p), list(q), list(o)
        extra = set()
        if len(t) % self.ubatch == 1:
            t, p, q, o = t + [0], p + [0], q + [SCRATCH_SEQ], o + [int(self.pad_float)]
            extra.add(len(t) - 1)
        if self.pad_float:
            for s in range(0, len(t), self.ubatch):
                chunk = range(s, min(s + self.ubatch, len(t)))
                if sum(o[i] for i in chunk) == 1:
                    i = next(i for i in chunk if not o[i])
                    o[i] = 1
                    extra.add(i)
        keep = np.array([i not in extra for i in range(len(t)) if o[i]], dtype=bool)
        return t, p, q, o, keep

    def __del__(self):  # the context and weights are C allocations
        try:
            self.close()
        except Exception:
            pass


class _Batch:
    """A llama_batch whose arrays are numpy buffers owned here, so one forward fills them in a few vector ops
    instead of a Python loop per token; each token belongs to one sequence."""

    def __init__(self, capacity: int):
        lib = import_llama_cpp()
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base, step = self.seq.ctypes.data, self.seq.itemsize
        self.seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *(ctypes.cast(base + i * step, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)))
        self.struct = lib.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens, pos, seqs, want) -> int:
        n = len(tokens)
        self.token[:n], self.pos[:n], self.seq[:n], self.logits[:n] = tokens, pos, seqs, want
        self.struct.n_tokens = n
        return int(self.logits[:n].sum())


def load_gguf_runner(path: str, kv_cache_tokens: int, block_size: int = 16) -> LlamaCppRunner:
    """The workers' loader for a GGUF file (target or draft)."""
    return LlamaCppRunner(path, kv_cache_tokens, block_size)


__all__ = ["LlamaCppRunner", "LlamaKVCache", "load_gguf_runner"]
