#!/usr/bin/env python3
"""Hostile load for scripts/flood-suite.sh.

  flood.py halfopen HOST PORT N HOLD_SECS   open N TCP connections, send nothing, hold them
  flood.py finclose HOST PORT N             N MPA v2 handshakes in a row, each closed with a FIN
                                            (shutdown, wait for the peer's FIN, close)

Prints one summary line; exit status 0 if every step it was asked for worked.
"""

import socket
import struct
import sys
import time

REQ_KEY = b"MPA ID Req Frame"
REP_KEY = b"MPA ID Rep Frame"
FLAG_R = 0x20  # reject
FLAG_H = 0x10  # enhanced (MPA v2: IRD/ORD word in the private data)


def halfopen(host, port, n, hold):
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect((host, port))
        except OSError as e:
            print(f"halfopen: connection {i} failed: {e}", file=sys.stderr)
            s.close()
            break
        socks.append(s)
    print(f"halfopen: {len(socks)} of {n} connections open", flush=True)
    time.sleep(hold)
    for s in socks:
        s.close()
    return len(socks) == n


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def mpa_request():
    # Revision 2, enhanced; IRD 16 ORD 16, no RTR flags.
    pd = struct.pack(">HH", 16, 16)
    return REQ_KEY + bytes([FLAG_H, 2]) + struct.pack(">H", len(pd)) + pd


def finclose(host, port, n):
    ok = 0
    first_error = None
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect((host, port))
            s.sendall(mpa_request())
            hdr = recv_exact(s, 20)
            if hdr[:16] != REP_KEY:
                raise ConnectionError(f"not an MPA reply: {hdr[:16]!r}")
            if hdr[16] & FLAG_R:
                raise ConnectionError("MPA reject")
            (pd_len,) = struct.unpack(">H", hdr[18:20])
            recv_exact(s, pd_len)
            s.shutdown(socket.SHUT_WR)
            # The peer's graceful close answers with its own FIN.
            while s.recv(4096):
                pass
            ok += 1
        except OSError as e:
            if first_error is None:
                first_error = f"connection {i}: {e}"
        finally:
            s.close()
    print(f"finclose: {ok} of {n} connections handshaken and FIN-closed"
          + (f" (first error: {first_error})" if first_error else ""), flush=True)
    return ok == n


def main(argv):
    if len(argv) >= 5 and argv[1] == "halfopen":
        return halfopen(argv[2], int(argv[3]), int(argv[4]), float(argv[5]) if len(argv) > 5 else 10)
    if len(argv) == 5 and argv[1] == "finclose":
        return finclose(argv[2], int(argv[3]), int(argv[4]))
    print(__doc__, file=sys.stderr)
    return False


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv) else 1)
