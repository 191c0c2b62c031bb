"""Files a model directory may carry besides its weights, read without torch (the caller's process checks them
before any worker starts): the reduced vocabulary of a draft and the feature layer of an EAGLE-style draft."""

from __future__ import annotations

import json
import os

VOCAB_MAP_FILE = "draft_vocab.json"  # a draft whose vocabulary is a subset of its target's (see load_vocab_map)
FEATURE_FILE = "eagle_fc.safetensors"  # a feature-conditioned (EAGLE-style) draft: see model_runner.load_feature_fc


def load_vocab_map(path: str) -> tuple[list[int], int] | None:
    """A reduced-vocabulary draft carries draft_vocab.json: {"target_vocab_size": V, "token_ids": [...]}. Its row i
    is target token token_ids[i]; its last row stands for every other token (inputs only, never proposed). Its
    probability outside token_ids is exactly zero, so rejection sampling stays lossless: the verifier's residual
    max(0, p - q) simply keeps p there."""
    f = os.path.join(path, VOCAB_MAP_FILE)
    if not os.path.exists(f):
        return None
    with open(f) as fh:
        m = json.load(fh)
    ids, V = [int(t) for t in m["token_ids"]], int(m["target_vocab_size"])
    if len(set(ids)) != len(ids) or not all(0 <= t < V for t in ids):
        raise ValueError(f"{f}: token_ids must be distinct ids below target_vocab_size={V}")
    return ids, V
