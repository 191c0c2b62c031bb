"""The ZeroMQ front end (`minedraft serve --bind`): wire protocol (protocol.py, docs/PROTOCOL.md), transport
(server.py), request tasks (requests.py), connection tracking (peers.py), access control (access.py)."""
