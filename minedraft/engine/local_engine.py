"""In-process baselines: target-alone decoding and standard (sequential) batched speculative decoding.

They run the very same Drafter/Verifier code as the worker processes, one after the other in one thread, with
continuous batching and KV admission, and the same rhythm object as the drafter process (minedraft/pipeline.py)
with one batch: each step drafts every running row, then verifies them. The two-batch pipeline is measured
against these.
"""

from __future__ import annotations

import itertools
from collections import deque

from transformers import AutoConfig, AutoTokenizer

from ..cache.admission import Admission
from ..config import EngineConfig
from ..errors import InvalidRequestError
from ..outputs import GenerationResult
from ..pipeline import Pipeline
from .request_state import RequestState, make_request
from ..models.check import eos_ids
from ..controls.logits import Controls
from ..runner.gguf import is_gguf, model_dir
from ..runner.llama_cpp import LlamaCppRunner
from ..runner.model_runner import ModelRunner
from ..drafting.load import load_draft
from ..drafting.suffix_drafter import make_drafter
from ..workers.verifier import Verifier


class LocalEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = config or EngineConfig(**overrides)
        cfg = self.config
        device = "cpu" if cfg.target_device == "auto" else cfg.target_device
        folder = model_dir(cfg.target)  # a GGUF target's tokenizer and config: its companion folder
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.k = cfg.draft_k
        self.max_draft = cfg.max_draft  # k, or k + tetris_extra with Tetris
        if is_gguf(cfg.target):
            self.target = LlamaCppRunner(cfg.target, cfg.kv_cache_tokens, cfg.block_size)
        else:
            self.target = ModelRunner.from_pretrained(cfg.target, cfg.kv_cache_tokens, cfg.block_size, device,
                                                      cfg.dtype)
        self.drafter = self.draft = None
        eos = eos_ids(AutoConfig.from_pretrained(folder, local_files_only=True), self.tokenizer)
        if self.k and cfg.draft_model:  # draft="suffix" needs no draft model
            ddev = "cpu" if cfg.draft_device == "auto" else cfg.draft_device
            self.draft = load_draft(cfg.draft_model, cfg.target, cfg.kv_cache_tokens, cfg.block_size, ddev, cfg.dtype)
            if self.draft.vocab_size != self.target.vocab_size:
                raise ValueError("draft and target vocabularies differ; they must share a tokenizer")
        if self.k:
            # output controls see the target's tokenizer and eos ids on both sides (controls/logits.py)
            self.drafter = make_drafter(self.draft, self.max_draft,
                                        (cfg.suffix_options or {}) if cfg.suffix_drafts else None, cfg.hybrid_threshold,
                                        Controls(self.target.vocab_size, eos, folder))
        self.verifier = Verifier(self.target, self.max_draft, eos, tokenizer_dir=folder,
                                 features=bool(self.drafter and self.drafter.features))
        self._ids = itertools.count()
        self.admission = Admission(cfg, self.max_draft)  # block tables and the prefix cache, as the scheduler's
        self.pipe = Pipeline(cfg.budget, two_batches=False)

    def generate(self, prompts: list, params=None) -> list[GenerationResult]:
        """Run every prompt to completion (continuous batching). params: one for all, or a list."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        states = []
        for prompt, p in zip(prompts, plist):
            rid = next(self._ids)
            states.append(RequestState(str(rid), make_request(rid, prompt, p, self.tokenizer, self.config,
                                                              self.target.vocab_size), self.tokenizer))
        waiting, running = deque(states), {}
        self.pipe = Pipeline(self.config.budget, two_batches=False)  # each run on its own: no row of an earlier one
        for s in states:
            if not self.admission.fits_ever(s.req):
                raise InvalidRequestError(f"request needs {s.req.cache_tokens(self.max_draft)} cache positions, "
                                          "more than the whole cache")
        while waiting or running:
            self._admit(waiting, running)
            if not running:  # nothing can ever free a block or compute a prefix: fail instead of spinning
                raise RuntimeError("no request can be admitted and none is running (blocks held outside generate?)")
            self.step(running)
        return [s.result() for s in states]

    def _admit(self, waiting, running) -> None:
        for s in self.admission.admit_from(waiting, self.config.max_batch_size - len(running)):
            self.verifier.add(s.req)  # both at once: nothing else is in flight (the step's adds are these)
            if self.drafter:
                self.drafter.add(s.req)
            self.pipe.add(s.req)
            running[s.req.rid] = s

    def step(self, running: dict) -> None:
        """One step of every running row: the pipeline's batch 0 is all of them (nothing else is in flight)."""
        st = self.pipe.next_step()
        if self.drafter and st.per_row:
            drafts, q = self.drafter.draft(st.rids, st.per_row, st.capacity)
        else:
            drafts, q = [[] for _ in st.rids], None
        self.pipe.drafts_ready(st.batch)
        results = self.verifier.verify(st.rids, drafts, q)
        finished = []
        for r, feats in zip(results, self.verifier.last_features):
            s = running[r.rid]
            s.on_result(r)
            self.admission.on_result(r.rid, r.new_tokens)
            if s.finished:
                finished.append(r.rid)
                del running[r.rid]
                self.admission.release(r.rid)
                if r.rid in self.verifier.seqs:  # a stop string ended it, not the verifier
                    self.verifier.remove(r.rid)
                if self.drafter:
                    self.drafter.remove(r.rid, r.new_tokens)
            elif self.drafter:
                self.drafter.apply(r.rid, r.num_accepted, r.new_tokens, feats)
        self.pipe.verdict(st.batch, finished)
