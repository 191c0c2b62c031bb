"""Front ends over one Engine: the ZeroMQ server and its wire protocol (zmq/), the OpenAI-compatible HTTP server
with metrics and the dashboard (http/). The Python client of the ZeroMQ protocol is `minedraft.client`."""
