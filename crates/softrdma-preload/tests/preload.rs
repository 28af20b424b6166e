//! The built library preloaded into real processes (Python socket programs):
//! policy decisions, bytes unchanged, the stats line at exit, fork.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::time::Duration;

use common::{field, have_python, python};

fn client_script(port: u16) -> String {
    format!(
        "import socket,sys\n\
         try:\n    s=socket.create_connection(('127.0.0.1',{port}))\n\
         except OSError as e:\n    print('error', e.errno); sys.exit(3)\n\
         s.sendall(bytes(range(256))*40); s.close()"
    )
}

fn received(l: &TcpListener) -> Vec<u8> {
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut v = Vec::new();
    s.read_to_end(&mut v).unwrap();
    v
}

#[test]
fn auto_connection_to_a_plain_server_stays_plain_byte_exact_and_is_counted() {
    if !have_python() {
        println!("SKIPPED: no python3");
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || received(&l));
    let (out, lines) = python(&client_script(port), &[]);
    assert!(out.status.success(), "{out:?}");
    let want: Vec<u8> = (0..=255u8).cycle().take(256 * 40).collect();
    assert_eq!(t.join().unwrap(), want);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let l = &lines[0];
    assert!(field(l, "exe").contains("python3"), "{l}");
    assert_eq!(field(l, "offloaded"), "0");
    assert_eq!(field(l, "plain"), "1");
    assert!(l.contains("\"reasons\":{\"peer not capable\":1}"), "{l}");
}

#[test]
fn tcp_policy_is_the_reason_when_set() {
    if !have_python() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || received(&l));
    let (out, lines) = python(&client_script(port), &[("SOFTRDMA_SOCKETS", "tcp")]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(t.join().unwrap().len(), 256 * 40);
    assert!(lines[0].contains("\"reasons\":{\"policy\":1}"), "{lines:?}");
}

#[test]
fn required_offload_is_refused_with_eopnotsupp_before_any_byte() {
    if !have_python() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let port = l.local_addr().unwrap().port();
    let (out, lines) = python(&client_script(port), &[("SOFTRDMA_SOCKETS", "offload")]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim(), format!("error {}", libc::EOPNOTSUPP));
    assert!(String::from_utf8_lossy(&out.stderr).contains("policy requires offload"));
    assert!(l.accept().is_err(), "no connection reached the server");
    assert_eq!(field(&lines[0], "refused"), "1");
    assert_eq!(field(&lines[0], "plain"), "0");
}

#[test]
fn rules_file_decides_per_address_and_port() {
    if !have_python() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("sockets.conf");
    std::fs::write(
        &conf,
        format!("# test\ntcp client python3* 127.0.0.0/8:{port}\nbogus line\n"),
    )
    .unwrap();
    let t = std::thread::spawn(move || received(&l));
    let (out, lines) = python(
        &client_script(port),
        &[
            ("SOFTRDMA_SOCKETS", "offload"),
            ("SOFTRDMA_SOCKETS_CONF", conf.to_str().unwrap()),
        ],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(t.join().unwrap().len(), 256 * 40);
    assert!(lines[0].contains("\"policy\":1"), "{lines:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sockets.conf:3:"), "{err}");
}

#[test]
fn accepted_connections_are_counted_on_the_server() {
    if !have_python() {
        return;
    }
    let script = "import socket,threading\n\
        l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(4)\n\
        p=l.getsockname()[1]\n\
        def cl():\n    c=socket.create_connection(('127.0.0.1',p)); c.sendall(b'x'); c.close()\n\
        threading.Thread(target=cl).start()\n\
        s,_=l.accept(); assert s.recv(1)==b'x'\n";
    let (out, lines) = python(script, &[("SOFTRDMA_SOCKETS", "auto")]);
    assert!(out.status.success(), "{out:?}");
    // One connect (client role) and one accept (server role), both ends
    // preloaded: offloaded.
    assert_eq!(field(&lines[0], "offloaded"), "2", "{lines:?}");
    assert_eq!(field(&lines[0], "plain"), "0", "{lines:?}");
}

#[test]
fn a_forked_child_reports_only_its_own_connections() {
    if !have_python() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || (received(&l), received(&l), received(&l)));
    let script = format!(
        "import os,socket,sys\n\
         def c():\n    s=socket.create_connection(('127.0.0.1',{port})); s.sendall(b'a'); s.close()\n\
         c()\n\
         pid=os.fork()\n\
         if pid==0:\n    c(); sys.exit(0)\n\
         os.waitpid(pid,0); c()\n"
    );
    let (out, lines) = python(&script, &[]);
    assert!(out.status.success(), "{out:?}");
    let _ = t.join().unwrap();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let mut plains: Vec<String> = lines.iter().map(|l| field(l, "plain")).collect();
    plains.sort();
    assert_eq!(
        plains,
        ["1", "2"],
        "child 1 connection, parent 2: {lines:?}"
    );
}

#[test]
fn settings_survive_a_program_clearing_its_environment() {
    // nginx clears the environment of the workers that accept connections.
    if !have_python() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || received(&l));
    let script = format!(
        "import os,socket\nos.environ.clear()\n\
         s=socket.create_connection(('127.0.0.1',{port})); s.sendall(b'z'); s.close()"
    );
    let (out, lines) = python(&script, &[("SOFTRDMA_SOCKETS", "tcp")]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(t.join().unwrap(), b"z");
    assert_eq!(lines.len(), 1, "the stats file was still known: {lines:?}");
    assert!(
        lines[0].contains("\"policy\":1"),
        "the mode was still known: {lines:?}"
    );
}

/// A server whose twin said it decides late queries is asked without
/// waiting: the client's next connection goes out while its query is
/// still unanswered, and the answer is read after the connect. The twin
/// here answers the second query only once that connection has arrived; a
/// client that waited for the answer before its SYN would time out and
/// count the server as not capable.
#[test]
fn a_twin_deciding_late_queries_is_asked_beside_the_syn() {
    use softrdma_sockets::detect::{FLAG_LATE_QUERY, Kind, Probe};
    if !have_python() {
        return;
    }
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let u = std::net::UdpSocket::bind(("127.0.0.1", port)).unwrap();
    let t = std::thread::spawn(move || {
        let mut b = [0u8; 64];
        let mut answer = |kind: Kind, then: &mut dyn FnMut()| {
            let (n, from) = u.recv_from(&mut b).unwrap();
            let q = Probe::decode(&b[..n]).unwrap();
            then();
            let a = Probe {
                kind,
                flags: FLAG_LATE_QUERY,
                ..q
            };
            u.send_to(&a.encode(), from).unwrap();
        };
        // The first query is accepted at once. This listener cannot
        // switch: its connection is dropped, and the client makes a plain
        // one in its place.
        answer(Kind::Accept, &mut || {});
        drop(l.accept().unwrap());
        let first = received(&l);
        // The second: declined once its connection is there.
        let mut second = None;
        answer(Kind::Decline, &mut || second = Some(l.accept().unwrap().0));
        let mut s = second.unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut v = Vec::new();
        s.read_to_end(&mut v).unwrap();
        (first, v)
    });
    let script = format!(
        "import socket\n\
         for i in range(2):\n    s=socket.create_connection(('127.0.0.1',{port})); s.sendall(bytes(range(256))*40); s.close()\n"
    );
    let (out, lines) = python(&script, &[]);
    assert!(out.status.success(), "{out:?}");
    let (first, second) = t.join().unwrap();
    assert_eq!(first.len(), 256 * 40);
    assert_eq!(second.len(), 256 * 40);
    let l = &lines[0];
    assert_eq!(field(l, "plain"), "2", "{l}");
    assert!(l.contains("\"peer declined\":1"), "{l}");
    assert!(l.contains("\"offload setup failed\":1"), "{l}");
}

/// The libraries the dynamic loader maps for `/bin/true` with the library
/// preloaded (glibc's `LD_TRACE_LOADED_OBJECTS`: list them, run nothing).
fn loaded_with_preload() -> String {
    let out = std::process::Command::new("/bin/true")
        .env("LD_PRELOAD", common::library())
        .env("LD_TRACE_LOADED_OBJECTS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The library carries its own unwinder: a preloaded C program maps no
/// `libgcc_s.so.1` (whose constructor runs `cpuid`s in every process).
#[test]
fn a_preloaded_program_loads_no_unwinder_library() {
    if option_env!("SOFTRDMA_UNWINDER_LINKED_IN").is_none() {
        println!("SKIPPED: no libgcc_eh.a to link the unwinder from");
        return;
    }
    let libs = loaded_with_preload();
    assert!(libs.contains("libsoftrdma_preload.so"), "{libs}");
    assert!(!libs.contains("libgcc_s"), "{libs}");
}
