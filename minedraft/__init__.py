"""minedraft: batch-parallel speculative decoding (draft one batch while verifying the other).

The public names are imported on first use (module __getattr__), so `import minedraft` (and the `minedraft`
command's --help and argument errors) does not pay for torch and transformers; `minedraft.Engine` etc. work as
plain attributes.
"""

from importlib import import_module

__all__ = ["Engine", "Client", "EngineConfig", "SamplingParams", "GenerationResult", "RequestStats", "StreamDelta",
           "MinedraftError", "InvalidRequestError", "OverloadedError", "EngineDeadError", "RequestAbortedError",
           "run"]
__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {"Engine": "engine.engine", "Client": "client", "EngineConfig": "config", "SamplingParams": "sampling_params",
         "GenerationResult": "outputs", "RequestStats": "outputs", "StreamDelta": "outputs",
         "MinedraftError": "errors", "InvalidRequestError": "errors", "OverloadedError": "errors",
         "EngineDeadError": "errors", "RequestAbortedError": "errors"}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'minedraft' has no attribute {name!r}")
    value = getattr(import_module(f".{mod}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def run(coro):
    """Run a coroutine on uvloop (the scheduler's loop of choice), falling back to asyncio."""
    try:
        import uvloop
        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        import asyncio
        return asyncio.run(coro)
