"""An executor process for the socket tests: it takes one job, says
``started``, prints the job id and then hangs (until it is killed)."""

from __future__ import annotations

import socket
import sys
import threading

from belay import protocol


def main(path: str) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    reader = protocol.FrameReader()

    def send(kind: str, **fields: object) -> None:
        conn.sendall(protocol.encode(protocol.message(kind, kind, **fields)))

    send("hello", mode="worker", runtime_id="doomed", max_concurrency=1)
    send("register_tasks", tasks=["sock.t"])
    while True:
        data = conn.recv(65536)
        if not data:
            return
        for message in reader.feed(data):
            if message["type"] == "execute":
                send("started", execution_id=message["execution_id"],
                     reservation_id=message["reservation_id"])
                print(message["job_id"], flush=True)
                threading.Event().wait()  # the job's work, forever


if __name__ == "__main__":
    main(sys.argv[1])
