"""Who may reach the server: bind endpoints (loopback unless allowed otherwise) and CURVE keys (loading, checking,
generating, and the allow-list of client keys)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import zmq
from zmq.utils import z85

from ..launch import is_loopback

log = logging.getLogger("minedraft.server")


# -- bind addresses ---------------------------------------------------------------------------------------------
class BindError(ValueError):
    """The bind endpoint is malformed or not allowed (non-loopback without allow_remote)."""


_OTHER_TRANSPORTS = ("pgm", "epgm", "norm", "tipc", "vmci", "ws", "wss", "udp")
_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:\[\]]*):(?P<port>\*|\d{1,5})$")


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc:// and inproc:// endpoints and tcp:// on a loopback address (127.0.0.0/8, ::1, localhost).
    Raises BindError for an endpoint that is not a bindable ZeroMQ address at all."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    scheme = endpoint.split("://", 1)[0] if "://" in endpoint else ""
    if scheme in _OTHER_TRANSPORTS:
        return False  # multicast, TIPC, websockets...: reachable from elsewhere
    m = _TCP.match(endpoint)
    if not m:
        raise BindError(f"cannot parse bind endpoint {endpoint!r}; expected tcp://HOST:PORT "
                        "(e.g. tcp://127.0.0.1:5555), tcp://[::1]:PORT or ipc:///path")
    port = m.group("port")
    if port != "*" and not 0 <= int(port) <= 65535:
        raise BindError(f"port {port} out of range in {endpoint!r}")
    return is_loopback(m.group("host").strip("[]"))  # '*', an interface or a host name: possibly not


def check_bind(endpoint: str, allow_remote: bool) -> None:
    if not is_loopback_endpoint(endpoint) and not allow_remote:
        raise BindError(f"refusing to bind {endpoint!r}: it is not a loopback address, so other machines could "
                        "reach the server. Pass --allow-remote (allow_remote=True) to bind it anyway, ideally "
                        "with CURVE keys (--curve-secret-key) so traffic is encrypted and the server "
                        "authenticated; or bind tcp://127.0.0.1:PORT.")


# -- CURVE keys -------------------------------------------------------------------------------------------------
def _z85_key(text: str) -> bytes | None:
    text = text.strip()
    if len(text) != 40:
        return None
    try:
        if len(z85.decode(text.encode("ascii"))) == 32:
            return text.encode("ascii")
    except Exception:
        return None
    return None


def load_key(path: str | os.PathLike, kind: str) -> bytes:
    """Read a z85 CURVE key (kind 'public' or 'secret') from a file: either the bare 40-character key (what
    `minedraft keygen` writes, from zmq.curve_keypair) or a zmq.auth certificate file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii", errors="replace")
    except OSError as e:
        raise ValueError(f"cannot read {kind} key file {str(p)!r}: {e.strerror}") from None
    key = _z85_key(text)
    if key is not None:
        return key
    try:
        import zmq.auth
        public, secret = zmq.auth.load_certificate(str(p))
    except Exception:
        public = secret = None
    key = secret if kind == "secret" else public
    if not key:
        raise ValueError(f"{str(p)!r} holds no z85 CURVE {kind} key (expected 40 z85 characters, as written by "
                         "`minedraft keygen`, or a zmq.auth certificate)")
    return key


def coerce_key(key, kind: str) -> bytes:
    """A key given as z85 str/bytes, or as a path to a key file."""
    if isinstance(key, bytes):
        key = key.decode("ascii", errors="replace")
    if isinstance(key, str):
        k = _z85_key(key)
        if k is not None:
            return k
    return load_key(key, kind)


def load_client_keys(path: str | os.PathLike) -> set[bytes]:
    """Public keys allowed to connect: a file with one key per line, or a directory of key files."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    keys: set[bytes] = set()
    for f in files:
        try:
            text = f.read_text(encoding="ascii", errors="replace")
        except OSError as e:
            raise ValueError(f"cannot read client key file {str(f)!r}: {e.strerror}") from None
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        found = [k for k in map(_z85_key, lines) if k]
        if found and len(found) == len(lines):
            keys.update(found)
        else:
            with contextlib.suppress(ValueError):
                keys.add(load_key(f, "public"))
    if not keys:
        raise ValueError(f"no z85 CURVE public keys found in {str(p)!r}")
    return keys


def write_keypair(secret_path: str | os.PathLike, public_path: str | os.PathLike, force: bool = False) -> str:
    """Make a CURVE keypair with zmq.curve_keypair(); the secret file is created 0600. Returns the public key."""
    public, secret = zmq.curve_keypair()
    for path in (secret_path, public_path):
        if os.path.exists(path) and not force:
            raise FileExistsError(f"{str(path)!r} exists; pass --force to overwrite it")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(secret_path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(secret.decode("ascii") + "\n")
    with open(public_path, "w") as f:
        f.write(public.decode("ascii") + "\n")
    return public.decode("ascii")


class _KeySet:
    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            log.warning("CURVE: rejected client key %s", key.decode("ascii", "replace"))
        return ok


def curve_keys(secret, public, client_keys) -> tuple[bytes | None, bytes | None, set[bytes] | None]:
    """The server's CURVE settings, checked: (secret, public, allowed client keys), each None when off. Keys may
    be z85 text or key-file paths; client_keys a collection of keys or a file/directory of them."""
    if secret is None:
        if public is not None:
            raise ValueError("a CURVE public key needs its secret key too (--curve-secret-key)")
        if client_keys is not None:
            raise ValueError("an allow-list of client keys needs CURVE on (--curve-secret-key)")
        return None, None, None
    secret = coerce_key(secret, "secret")
    derived = zmq.curve_public(secret)
    if public is not None and coerce_key(public, "public") != derived:
        raise ValueError("the CURVE public key does not belong to the secret key")
    if client_keys is not None:
        keys = set(client_keys) if isinstance(client_keys, (set, list, tuple)) else load_client_keys(client_keys)
        client_keys = {coerce_key(k, "public") for k in keys}
    return secret, derived, client_keys


def start_authenticator(ctx, keys: set[bytes]):
    """ZAP handler on ctx that admits only the given client public keys (stop() it with the context)."""
    from zmq.auth.asyncio import AsyncioAuthenticator
    auth = AsyncioAuthenticator(ctx, log=logging.getLogger("minedraft.server.auth"))
    auth.start()
    auth.configure_curve_callback("*", _KeySet(keys))
    return auth
