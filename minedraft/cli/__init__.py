"""The `minedraft` command: the parser and `generate` (main.py), what the commands share (common.py), `serve` and
`keygen` (serve.py), `models list / pull` (models.py); `bench` forwards to minedraft.bench.runner."""

from .main import entry

__all__ = ["entry"]
