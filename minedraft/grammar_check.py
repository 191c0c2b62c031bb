"""A request's grammar text (JSON Schema, regular expression or Lark) compiled and checked by llguidance, with no
tokenizer: SamplingParams runs this in the caller's process so a bad grammar is a clear error before any worker
sees it; the workers' matcher (controls/grammar.py) starts from the same compiled text."""

from __future__ import annotations

import functools
import json

from .errors import InvalidRequestError

KINDS = ("json_schema", "regex", "grammar")
# compact JSON: no whitespace between tokens (a schema's "x-guidance" may say otherwise). Flexible whitespace lets
# a model spend its tokens on blanks, and a small one does
JSON_OPTIONS = {"whitespace_flexible": False}


def _grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for one of KINDS (raises InvalidRequestError on a malformed JSON schema text)."""
    import llguidance as llg
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise InvalidRequestError(f"json_schema is not valid JSON: {e}", kind) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("json_schema must be a JSON object (a JSON Schema)", kind)
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else text,
                                                          defaults=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidRequestError(f"invalid json_schema: {e}", kind) from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    return llg.LLMatcher.grammar_from_lark(text)


@functools.lru_cache(maxsize=256)
def compiled(kind: str, text: str) -> str:
    """The grammar for (kind, text), checked: a request's problem is an InvalidRequestError naming it, raised in
    the caller's process before any worker sees the request."""
    import llguidance as llg
    if kind not in KINDS:
        raise InvalidRequestError(f"unknown grammar kind {kind!r}", kind)
    g = _grammar_text(kind, text)
    err = llg.LLMatcher.validate_grammar(g)
    if err:
        what = {"json_schema": "json_schema", "regex": "regular expression", "grammar": "grammar (Lark)"}[kind]
        raise InvalidRequestError(f"invalid {what}: {err.strip()}", kind)
    return g


def check(kind: str, text: str) -> None:
    compiled(kind, text)
