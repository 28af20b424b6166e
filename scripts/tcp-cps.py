#!/usr/bin/env python3
# Plain TCP connect/accept pairs on loopback: 100 connections, like dtestcm -c 100.
import socket, threading, time
N = 100
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0)); srv.listen(128)
acc = []
def accept():
    for _ in range(N):
        acc.append(srv.accept()[0])
t = threading.Thread(target=accept); t.start()
start = time.perf_counter()
cs = []
for _ in range(N):
    c = socket.create_connection(srv.getsockname()); cs.append(c)
t.join()
el = time.perf_counter() - start
print(f"TCP connect/accept: {N} pairs in {el*1e3:.2f} ms, CPS {N/el:.0f}")
