//! The fallback matrix between two hosts: two network namespaces joined
//! by a veth pair (created here; skipped with a message where that is not
//! permitted). Each side runs in a child process of this test binary
//! (`netns_child`, ignored when run on its own).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use softrdma_sockets::{Config, Mode, TcpListener, TcpStream};

const BANNER: &[u8] = b"SSH-2.0-server-speaks-first\r\n";

fn serve<S: Read + Write>(s: S) {
    common::serve(s, BANNER);
}

fn session<S: Read + Write>(s: S, shut: impl FnOnce(&S)) {
    let data: Vec<u8> = (0..500_000u32).map(|i| (i ^ (i >> 9)) as u8).collect();
    common::session(s, BANNER, &data, 60_000, shut);
}

fn close_reply() -> Vec<u8> {
    (0..3_000_000u32)
        .map(|i| (i * 7 + (i >> 11)) as u8)
        .collect()
}

fn mode(s: &str) -> Mode {
    match s {
        "offload" => Mode::Offload,
        "tcp" => Mode::Tcp,
        _ => Mode::Auto,
    }
}

/// One side of a case (run by the parent inside a namespace).
#[test]
#[ignore = "child process of across_namespaces"]
fn netns_child() {
    let Ok(role) = std::env::var("SD_ROLE") else {
        return;
    };
    let addr = std::env::var("SD_ADDR").unwrap();
    let m = std::env::var("SD_MODE").unwrap();
    let expect = std::env::var("SD_EXPECT").unwrap();
    match role.as_str() {
        "server" if m == "std" => {
            let l = std::net::TcpListener::bind(&addr).unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            serve(l.accept().unwrap().0);
        }
        "server" if m == "close" => {
            // Closes right after writing a bulk reply (the client has
            // already sent its DisConn): our DisConn must follow the data.
            let l = TcpListener::bind_with(&addr, &Config::with_mode(Mode::Offload)).unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            let (mut s, _) = l.accept().unwrap();
            let mut req = [0u8; 8];
            s.read_exact(&mut req).unwrap();
            s.write_all(&close_reply()).unwrap();
            drop(s);
        }
        "client" if m == "close" => {
            let mut c = TcpStream::connect_with(&addr, &Config::with_mode(Mode::Offload)).unwrap();
            c.write_all(b"request!").unwrap();
            // Our DisConn right after the request, then the reply to EOF.
            c.shutdown(Shutdown::Write).unwrap();
            let mut rest = Vec::new();
            c.read_to_end(&mut rest).unwrap();
            assert!(rest == close_reply(), "{} octets", rest.len());
            println!(
                "client transport: {} EOF after {} octets",
                c.transport(),
                rest.len()
            );
        }
        "server" => {
            let l = TcpListener::bind_with(&addr, &Config::with_mode(mode(&m))).unwrap();
            println!("READY");
            std::io::stdout().flush().unwrap();
            let (s, _) = l.accept().unwrap();
            println!("server transport: {}", s.transport());
            assert_eq!(s.transport().is_offloaded(), expect == "offloaded");
            serve(s);
        }
        "client" if m == "std" => {
            let c = std::net::TcpStream::connect(&addr).unwrap();
            session(c, |s| s.shutdown(Shutdown::Write).unwrap());
        }
        _ => {
            let c = TcpStream::connect_with(&addr, &Config::with_mode(mode(&m))).unwrap();
            println!("client transport: {}", c.transport());
            assert_eq!(c.transport().is_offloaded(), expect == "offloaded");
            session(c, |s| s.shutdown(Shutdown::Write).unwrap());
        }
    }
}

struct Netns {
    names: Vec<String>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn child(ns: &str, envs: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new("timeout");
    c.args(["60", "ip", "netns", "exec", ns])
        .arg(exe)
        .args(["--exact", "netns_child", "--include-ignored", "--nocapture"])
        .stdout(Stdio::piped());
    for (k, v) in envs {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

#[test]
fn across_namespaces() {
    let id = std::process::id() % 10_000;
    let (a, b) = (format!("sda{id}"), format!("sdb{id}"));
    if !ip(&["netns", "add", &a]) {
        eprintln!("SKIP across_namespaces: `ip netns add` not permitted here");
        return;
    }
    let mut guard = Netns {
        names: vec![a.clone()],
    };
    assert!(ip(&["netns", "add", &b]));
    guard.names.push(b.clone());
    let (va, vb) = (format!("sdva{id}"), format!("sdvb{id}"));
    let net = format!("10.{}.{}", 100 + id % 100, id / 100 % 250);
    let (ipa, ipb) = (format!("{net}.1"), format!("{net}.2"));
    assert!(ip(&[
        "link", "add", &va, "type", "veth", "peer", "name", &vb
    ]));
    assert!(ip(&["link", "set", &va, "netns", &a]));
    assert!(ip(&["link", "set", &vb, "netns", &b]));
    for (ns, dev, addr) in [(&a, &va, &ipa), (&b, &vb, &ipb)] {
        assert!(ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            dev
        ]));
        assert!(ip(&["-n", ns, "link", "set", dev, "up"]));
        assert!(ip(&["-n", ns, "link", "set", "lo", "up"]));
    }
    // (server mode, client mode, expected transport)
    let cases = [
        ("auto", "auto", "offloaded"),
        ("auto", "offload", "offloaded"),
        ("std", "auto", "plain"),
        ("auto", "std", "plain"),
        ("tcp", "auto", "plain"),
        // The server closes right after a bulk reply: EOF after all of it.
        ("close", "close", "offloaded"),
        ("close", "close", "offloaded"),
        ("close", "close", "offloaded"),
    ];
    for (i, (sm, cm, expect)) in cases.into_iter().enumerate() {
        let addr = format!("{ipb}:{}", 7100 + i);
        let mut server = child(
            &b,
            &[
                ("SD_ROLE", "server".into()),
                ("SD_ADDR", addr.clone()),
                ("SD_MODE", sm.into()),
                ("SD_EXPECT", expect.into()),
            ],
        );
        let mut out = BufReader::new(server.stdout.take().unwrap());
        let start = Instant::now();
        let mut line = String::new();
        while !line.contains("READY") {
            line.clear();
            if out.read_line(&mut line).unwrap() == 0 || start.elapsed() > Duration::from_secs(30) {
                panic!("server of case {i} did not start");
            }
        }
        let mut client = child(
            &a,
            &[
                ("SD_ROLE", "client".into()),
                ("SD_ADDR", addr.clone()),
                ("SD_MODE", cm.into()),
                ("SD_EXPECT", expect.into()),
            ],
        );
        let mut cout = String::new();
        client
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut cout)
            .unwrap();
        let cs = client.wait().unwrap();
        let mut sout = String::new();
        out.read_to_string(&mut sout).unwrap();
        let ss = server.wait().unwrap();
        eprintln!("case {i} ({sm} server, {cm} client): {cout}{sout}");
        assert!(cs.success(), "client of case {i} failed: {cout}");
        assert!(ss.success(), "server of case {i} failed: {sout}");
    }
}
