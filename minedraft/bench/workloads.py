"""Grounded chat prompts: requests whose answer reuses text given in the prompt (the suffix drafter's workload).

Built from what every Python install carries, so no data set is downloaded (the exact texts follow the Python
version): functions of the standard library's own source ("edit this function"), passages of `pydoc_data.topics`
(quote the sentence that says X, summarise with quotes), tables of `http.HTTPStatus` and `errno` ("convert this
table to JSON"), and multi-turn chats whose last turn asks to restate an earlier answer. Each prompt is a list of
OpenAI-style messages. `split="dev"` and `split="test"` are disjoint (alternate items of each kind): the suffix
knobs were chosen on dev, the bench runs test.
"""

from __future__ import annotations

import inspect
import random
import re

_MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "bisect", "heapq", "colorsys", "string", "difflib",
            "calendar", "glob", "keyword", "base64", "quopri", "html", "ipaddress", "statistics", "json.decoder",
            "json.encoder", "urllib.parse", "email.utils", "csv", "uu", "netrc", "mimetypes", "zipfile")
_EDITS = ("Add a docstring to this function and return the whole function.",
          "Rename every local variable to a clearer name. Show the full updated function.",
          "Add type hints to this function. Reply with the complete function.",
          "Add a comment above each line that is not obvious. Give back the whole function.",
          "Rewrite this function so that it is easier to read, keeping its behaviour. Show the result.")


def _functions(max_chars: int) -> list[tuple[str, str]]:
    import importlib
    out = []
    for mod in _MODULES:
        try:
            m = importlib.import_module(mod)
        except ImportError:   # removed from newer Pythons (uu); the set just gets smaller
            continue
        for name, f in sorted(vars(m).items()):
            if inspect.isfunction(f) and f.__module__ == m.__name__ and not name.startswith("_"):
                try:
                    src = inspect.getsource(f)
                except (OSError, TypeError):
                    continue
                if 200 <= len(src) <= max_chars:
                    out.append((f"{mod}.{name}", src))
    return out


def _passages(max_chars: int) -> list[tuple[str, str]]:
    from pydoc_data.topics import topics
    out = []
    for name in sorted(topics):
        body = topics[name].split("\n\n", 1)[-1]   # drop the title
        paras = [p for p in body.split("\n\n") if len(p) > 150 and not p.startswith("   ")]  # prose, not grammar
        text = ""
        for p in paras:
            if len(text) + len(p) > max_chars:
                break
            text += p + "\n\n"
        if len(text) > 300:
            out.append((name, text.strip()))
    return out


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if 40 <= len(s) <= 300]


def _tables() -> list[tuple[str, str, list[str]]]:
    import errno
    import http
    import os
    rows = [(str(s.value), s.phrase, s.description) for s in http.HTTPStatus]
    errs = [(name, str(num), os.strerror(num)) for num, name in sorted(errno.errorcode.items())]
    tables = []
    for i in range(0, len(rows), 6):
        tables.append(("HTTP status codes", "code | phrase | description", [" | ".join(r) for r in rows[i:i + 6]]))
    for i in range(0, len(errs), 6):
        tables.append(("errno codes", "name | number | message", [" | ".join(r) for r in errs[i:i + 6]]))
    return tables


def grounded_prompts(n: int | None = None, split: str = "test", seed: int = 0, max_chars: int = 1800
                     ) -> list[list[dict]]:
    """Grounded chat requests (lists of messages), the kinds interleaved; n=None gives the whole split.
    max_chars bounds the quoted material (about 4 characters a token in SmolLM2's tokenizer)."""
    if split not in ("dev", "test"):
        raise ValueError("split must be 'dev' or 'test'")
    rng = random.Random(seed)
    pick = (lambda xs: xs[0::2]) if split == "dev" else (lambda xs: xs[1::2])
    kinds: list[list[list[dict]]] = [[], [], [], []]
    for i, (name, src) in enumerate(pick(_functions(max_chars))):
        kinds[0].append([{"role": "user", "content": f"{_EDITS[i % len(_EDITS)]}\n\n```python\n{src}```"}])
    for i, (name, text) in enumerate(pick(_passages(max_chars))):
        sents = _sentences(text)
        if i % 2 == 0 and sents:
            s = rng.choice(sents)
            words = re.findall(r"[A-Za-z_]+", s)
            phrase = " ".join(words[len(words) // 3:len(words) // 3 + 3])
            ask = f"Quote, word for word, the sentence of this passage that mentions \"{phrase}\"."
        else:
            ask = "Summarise this passage in a few sentences, quoting its own words where you can."
        kinds[1].append([{"role": "user", "content": f"{text}\n\n{ask}"}])
    for title, header, rows in pick(_tables()):
        table = "\n".join([header, *rows])
        kinds[2].append([{"role": "user", "content": f"Convert this table of {title} to JSON: a list of objects, "
                          f"one per row, with the column names as keys.\n\n{table}"}])
    for i, (name, text) in enumerate(pick(_passages(max_chars // 2))):
        q = f"What does the Python documentation say about {name.replace('-', ' ')}?"
        again = ("Repeat your previous answer exactly, then add one sentence of your own." if i % 2 == 0
                 else "Restate your previous answer as a bulleted list, keeping its wording.")
        kinds[3].append([{"role": "user", "content": q}, {"role": "assistant", "content": text},
                         {"role": "user", "content": again}])
    for k in kinds:
        rng.shuffle(k)
    out = [k[i] for i in range(max(map(len, kinds))) for k in kinds if i < len(k)]
    return out if n is None else [out[i % len(out)] for i in range(n)]
