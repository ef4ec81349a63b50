"""The xApp service: ricllm behind a ZeroMQ ROUTER socket, with O-RAN health and metrics over HTTP.

The wire format is ``ricllm.protocol`` (pydantic + msgpack, no torch), below both the server and
``ricllm.client``: the server's HTTP side is itself a client of the socket. See
``docs/protocol.md``. Nothing is imported here, so ``ricllm keys`` (``keys``) loads no engine.
"""
