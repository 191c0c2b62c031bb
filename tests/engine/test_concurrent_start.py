"""Engines started concurrently in one process (asyncio.gather of Engine.start) all come up and answer.

Run in a fresh interpreter: the race was in transformers' lazy imports, which this test process has done already
(conftest imports it), so only a process that imports it for the first time, from two threads at once, shows it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from minedraft import Engine, EngineConfig, SamplingParams

    async def main(n):
        cfg = dict(target=sys.argv[2], draft=sys.argv[3], mode="minedraft", kv_cache_tokens=1024,
                   max_prompt_tokens=64, max_tokens_limit=16, max_batch_size=2)
        got = await asyncio.gather(*[Engine.start(EngineConfig(**cfg)) for _ in range(n)], return_exceptions=True)
        bad = [repr(e) for e in got if isinstance(e, BaseException)]
        ok = [e for e in got if not isinstance(e, BaseException)]
        try:
            texts = [(await e.generate("Hello", SamplingParams(max_tokens=4, temperature=0))).token_ids for e in ok]
        finally:
            for e in ok:
                await e.shutdown()
        print("failed:", bad)
        print("same:", len(set(map(tuple, texts))) == 1, len(texts))
        sys.exit(1 if bad else 0)

    if __name__ == "__main__":
        asyncio.run(main(int(sys.argv[1])))
""")


@pytest.mark.parametrize("n", [2, 4])
def test_engines_started_at_once_all_start(tmp_path, tiny_pair, n):
    script = tmp_path / "many.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    r = subprocess.run([sys.executable, str(script), str(n), tiny_pair.target, tiny_pair.draft], env=env,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "failed: []" in r.stdout
    assert f"same: True {n}" in r.stdout  # every engine answers, and greedily the same
