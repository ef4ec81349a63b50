"""With ``engine_cpus`` the server's socket, HTTP and libzmq threads run on the other CPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

ALLOWED = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _libzmq_threads() -> set[int]:
    return {int(t.name) for t in Path("/proc/self/task").iterdir()
            if (t / "comm").read_text().startswith("ZMQbg")}


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs this process may use")
def test_the_server_keeps_its_other_threads_off_the_engine_cpus(start_server):
    from ricllm.client import RicClient

    zmq.Context.instance().socket(zmq.DEALER).close(linger=0)  # the clients' I/O threads exist before
    earlier = _libzmq_threads()
    engine_cpu, before = min(ALLOWED), os.sched_getaffinity(0)
    server = start_server(engine={"engine_cpus": [0]}).server  # the first CPU this process may run on
    others = ALLOWED - {engine_cpu}
    with RicClient(server.endpoint, timeout_s=30) as client:
        assert len(client.generate("hello", max_tokens=3, ignore_eos=True).token_ids) == 3
    socket_thread, engine_thread = server._threads
    assert os.sched_getaffinity(engine_thread.native_id) == {engine_cpu}
    assert os.sched_getaffinity(socket_thread.native_id) == others
    assert os.sched_getaffinity(server._http._thread.native_id) == others
    servers_libzmq = _libzmq_threads() - earlier
    assert servers_libzmq and all(os.sched_getaffinity(tid) == others for tid in servers_libzmq)
    assert os.sched_getaffinity(0) == before  # the thread that started the server keeps its CPUs
