"""minedraft: batch-parallel speculative decoding (draft one batch while verifying the other)."""

from .client import Client
from .config import EngineConfig
from .engine import Engine
from .errors import EngineDeadError, InvalidRequestError, MinedraftError, OverloadedError, RequestAbortedError
from .outputs import GenerationResult, RequestStats, StreamDelta
from .sampling_params import SamplingParams

__all__ = ["Engine", "Client", "EngineConfig", "SamplingParams", "GenerationResult", "RequestStats", "StreamDelta",
           "MinedraftError", "InvalidRequestError", "OverloadedError", "EngineDeadError", "RequestAbortedError",
           "run"]
__version__ = "0.1.0"


def run(coro):
    """Run a coroutine on uvloop (the scheduler's loop of choice), falling back to asyncio."""
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        import asyncio
        return asyncio.run(coro)
