//! A preloaded process that exits (`exit(3)`) without closing an
//! offloaded connection: what it held (its own `TCP_CORK`, an autocork
//! hold) reaches the peer, then EOF, as with the kernel's TCP. The writer
//! is a forked child of the Python program (its connection is its own),
//! which ends with the C library's `exit`, skipping Python's finalization
//! (which would close the socket).

mod common;

use common::{have_python, python};

/// The reader (the parent) and the writer (a forked child, running
/// `child`, which ends by `exit(0)` with the socket `c` open); the parent
/// checks that it read exactly `want` (a Python expression), then EOF.
fn child_exits_with_data_held(child: &str, want: &str, env: &[(&str, &str)]) {
    let script = format!(
        "import socket,os,sys,select,ctypes\n\
         l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(8)\n\
         port=l.getsockname()[1]\n\
         pid=os.fork()\n\
         if pid==0:\n    \
             c=socket.create_connection(('127.0.0.1',port))\n    \
             c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
         {child}    \
             ctypes.CDLL(None).exit(0)\n\
         s,_=l.accept()\n\
         b=bytearray()\n\
         while True:\n    \
             x=s.recv(65536)\n    \
             if not x: break\n    \
             b+=x\n\
         want={want}\n\
         assert bytes(b)==want, (len(b), len(want))\n\
         _,st=os.waitpid(pid,0); assert st==0, st\n\
         print('DONE')\n"
    );
    let mut all = vec![("SOFTRDMA_SOCKETS", "auto")];
    all.extend_from_slice(env);
    let (out, lines) = python(&script, &all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("DONE"),
        "status {:?}\nstdout {stdout}\nstderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // The parent's line and the child's: the connection was offloaded.
    assert!(
        lines.iter().any(|l| l.contains("\"offloaded\":1")),
        "{lines:?}"
    );
}

/// Regression: writes held by the application's `TCP_CORK` were lost when
/// the process exited without closing the socket (the peer saw the
/// connection reset); the kernel sends them at the implicit close.
#[test]
fn corked_data_is_sent_when_a_preloaded_process_exits_without_closing() {
    if !have_python() {
        return;
    }
    child_exits_with_data_held(
        "    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)\n    \
             d=bytes(range(256))*20\n    \
             c.sendall(d[:100]); c.sendall(d[100:])\n",
        "bytes(range(256))*20",
        &[],
    );
}

/// A send held by the library's autocork (the connection's bursts are
/// two sends; the hold limit is set far beyond the test) when the
/// process exits: the preload's exit handler and sockets direct's exit
/// flush both run; the octet goes, in order, then EOF.
#[test]
fn an_autocork_hold_is_sent_when_a_preloaded_process_exits() {
    if !have_python() {
        return;
    }
    child_exits_with_data_held(
        "    for i in range(3):\n        \
                 c.send(b'h'); c.send(b'b'); select.select([],[c],[],5)\n    \
             c.send(b'h')\n",
        "b'hbhbhbh'",
        &[("SOFTRDMA_SOCKETS_AUTOCORK", "100000")],
    );
}
