"""An executor process whose job kills it (tests/test_handbacks.py): it takes
one job, says ``started``, prints the job id, the attempt and its node id,
then kills its own process with SIGKILL — as a job that crashes its executor
(native code, ``os._exit``, out of memory) does every time it runs."""

from __future__ import annotations

import os
import signal
import socket
import sys

from belay import protocol


def main(path: str, task: str) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    reader = protocol.FrameReader()

    def send(kind: str, **fields: object) -> None:
        conn.sendall(protocol.encode(protocol.message(kind, kind, **fields)))

    send("hello", mode="worker", runtime_id="poison", max_concurrency=1)
    send("register_tasks", tasks=[task])
    node = "?"
    while True:
        data = conn.recv(65536)
        if not data:
            return
        for message in reader.feed(data):
            if message["type"] == "hello_ok":
                node = message["node_id"]
            elif message["type"] == "execute":
                send("started", execution_id=message["execution_id"],
                     reservation_id=message["reservation_id"])
                print(message["job_id"], message["attempt"], node, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
