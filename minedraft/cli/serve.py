"""`minedraft serve` (ZeroMQ and/or HTTP) and `minedraft keygen`: the network side of the command line."""

from __future__ import annotations

import os
import signal
import sys

from .common import ZMQ_DEFAULT_BIND, _engine_kw, _fail, _name_options, _quiet_libraries, _run_async
from ..config import EngineConfig


# -- serve ------------------------------------------------------------------------------------------------------
def cmd_serve(a) -> int:
    import logging
    if a.http is not None:
        return _serve_http(a)
    if a.bind is None:
        a.bind = ZMQ_DEFAULT_BIND

    from ..serving.zmq.server import serve
    from ..serving.zmq.access import BindError, check_bind
    from ..errors import MinedraftError
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_bind(a.bind, a.allow_remote)  # before anything slow
        cfg = EngineConfig(**_engine_kw(a), max_tokens_limit=a.max_tokens_limit, max_batch_size=a.max_batch_size,
                           kv_cache_tokens=a.kv_cache_tokens, max_queue=a.max_queue,
                           kv_cache_memory_fraction=a.kv_cache_memory_fraction)
    except (BindError, ValueError) as e:
        return _fail(_name_options(str(e)))
    _quiet_libraries()

    try:
        sig = _run_async(serve(cfg, a.bind, ready=_print_lines, allow_remote=a.allow_remote,
                               curve_secret_key=a.curve_secret_key, curve_public_key=a.curve_public_key,
                               curve_client_keys=a.curve_client_keys, max_message_bytes=a.max_message_bytes,
                               max_inflight_per_client=a.max_inflight_per_client,
                               max_queued_replies=a.max_queued_replies,
                               stay_up_when_dead=a.stay_up_on_worker_death), not a.no_uvloop)
    except (BindError, ValueError, MinedraftError) as e:
        return _fail(str(e), 1)
    except Exception as e:
        logging.getLogger("minedraft.server").debug("serve failed", exc_info=True)
        return _fail(f"{type(e).__name__}: {e}", 1)
    return _exit_code(sig)


def _print_lines(lines) -> None:
    print("\n".join(lines), flush=True)


def _exit_code(sig) -> int:
    from ..serving.launch import ENGINE_DIED, EXIT_ENGINE_DIED
    if sig == ENGINE_DIED:
        return EXIT_ENGINE_DIED  # a worker died: non-zero, so a supervisor restarts the server
    if sig == signal.SIGINT:
        raise KeyboardInterrupt  # stopped cleanly by Ctrl-C: main() reports it like any other interrupt
    return 0


def _serve_http(a) -> int:
    import logging

    from ..errors import MinedraftError
    from ..serving.http.serve import HTTPBindError, bind_socket
    from ..serving.zmq.access import BindError, check_bind
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # addresses first: a refused or busy one fails before the models load
        bind_socket(a.http, a.allow_remote).close()
        if a.bind is not None:
            check_bind(a.bind, a.allow_remote)
        cfg = EngineConfig(**_engine_kw(a), max_tokens_limit=a.max_tokens_limit, max_batch_size=a.max_batch_size,
                           kv_cache_tokens=a.kv_cache_tokens, max_queue=a.max_queue,
                           kv_cache_memory_fraction=a.kv_cache_memory_fraction)
    except (HTTPBindError, BindError, ValueError) as e:
        return _fail(str(e))
    _quiet_libraries()
    from ..serving.http.serve import serve_http

    from ..serving.http.guard import ConnectionLimits
    cap = {} if a.http_max_connections is None else {"max_connections": a.http_max_connections}
    limits = ConnectionLimits(a.http_header_timeout, a.http_body_timeout, **cap, refusal_rate=a.http_refusal_rate)
    api_key = a.api_key if a.api_key is not None else os.environ.get("MINEDRAFT_API_KEY") or None
    try:
        # a named pair (--model, where the CLI has it) is also the id clients send
        model_name = a.model_name or getattr(a, "model", None)
        sig = _run_async(serve_http(cfg, a.http, zmq_bind=a.bind, api_key=api_key, model_name=model_name,
                                    allow_remote=a.allow_remote, ready=_print_lines,
                                    max_body_bytes=a.max_message_bytes,
                                    log_level="warning" if a.log_level == "info" else a.log_level, limits=limits,
                                    curve_secret_key=a.curve_secret_key, curve_public_key=a.curve_public_key,
                                    curve_client_keys=a.curve_client_keys, max_message_bytes=a.max_message_bytes,
                                    max_inflight_per_client=a.max_inflight_per_client,
                                    stay_up_when_dead=a.stay_up_on_worker_death), not a.no_uvloop)
    except (HTTPBindError, BindError, ValueError, MinedraftError) as e:
        return _fail(str(e), 1)
    except Exception as e:
        logging.getLogger("minedraft.http").debug("serve failed", exc_info=True)
        return _fail(f"{type(e).__name__}: {e}", 1)
    return _exit_code(sig)


# -- keygen -----------------------------------------------------------------------------------------------------
def cmd_keygen(a) -> int:
    from ..serving.zmq.access import write_keypair
    os.makedirs(a.out_dir, exist_ok=True)
    secret = os.path.join(a.out_dir, f"{a.name}.secret")
    public = os.path.join(a.out_dir, f"{a.name}.public")
    try:
        key = write_keypair(secret, public, force=a.force)
    except (FileExistsError, OSError) as e:
        return _fail(str(e), 1)
    print(f"secret key: {secret}\npublic key: {public}\n{key}")
    return 0
