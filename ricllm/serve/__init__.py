"""The xApp service: ricllm behind a ZeroMQ ROUTER socket, with O-RAN health and metrics over HTTP.

``ricllm.serve.protocol`` is the wire format (pydantic + msgpack only, no torch) shared by the
server and by ``ricllm.client``; see ``docs/protocol.md``. Nothing is imported here so that a
client process never pulls in the engine.
"""
