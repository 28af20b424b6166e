//! Which connections may be offloaded: a mode from the environment and an
//! optional rules file, decided per program, role, address and port.
//!
//! `SOFTRDMA_SOCKETS=auto|offload|tcp` sets the default (auto). The rules
//! file named by `SOFTRDMA_SOCKETS_CONF` holds one rule per line; the first
//! that matches decides:
//!
//! ```text
//! # mode    role                  program   address[/prefix][:port[-port]]
//! tcp       both                  sshd      *
//! offload   client                iperf3    127.0.0.1:5201
//! auto      server                *         0.0.0.0/0:6379
//! ```
//!
//! `mode` is `auto` (offload when the peer can), `offload` (required: a
//! connection that cannot be offloaded fails) or `tcp` (plain). `role` is
//! `client` (connect), `server` (accept) or `both`. `program` is a glob (`*`,
//! `?`) on the executable's file name. The address is the peer's for a
//! client and the local one for a server; `*` matches any, a prefix length
//! defaults to the whole address, the port (or range) to any. `#` starts a
//! comment.

use std::net::IpAddr;

/// What a connection may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Offload when the peer can, plain TCP otherwise.
    Auto,
    /// Offload or fail.
    Offload,
    /// Plain TCP.
    Tcp,
}

impl Mode {
    pub(crate) fn parse(s: &str) -> Option<Mode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Mode::Auto),
            "offload" => Some(Mode::Offload),
            "tcp" | "plain" => Some(Mode::Tcp),
            _ => None,
        }
    }
}

/// Which side of a connection this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// It called `connect`.
    Client,
    /// It accepted the connection.
    Server,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RoleMatch {
    Client,
    Server,
    Both,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    mode: Mode,
    role: RoleMatch,
    program: String,
    /// None: any address.
    net: Option<(IpAddr, u8)>,
    ports: (u16, u16),
}

/// A rules-file line that could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RuleError {
    /// 1-based line number.
    pub(crate) line: usize,
    /// What is wrong.
    pub(crate) what: String,
}

/// The default mode and the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Policy {
    default: Mode,
    rules: Vec<Rule>,
}

impl Policy {
    /// A policy with no rules.
    pub(crate) fn new(default: Mode) -> Policy {
        Policy {
            default,
            rules: Vec::new(),
        }
    }

    /// Adds the rules of a file's text; bad lines are returned (and skipped).
    pub(crate) fn add_rules(&mut self, text: &str) -> Vec<RuleError> {
        let mut errors = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            match parse_rule(line) {
                Ok(r) => self.rules.push(r),
                Err(what) => errors.push(RuleError { line: i + 1, what }),
            }
        }
        errors
    }

    /// The mode for a connection of `program` in `role` with `addr:port`
    /// (the peer's for a client, the local one for a server).
    pub(crate) fn decide(&self, program: &str, role: Role, addr: IpAddr, port: u16) -> Mode {
        self.rules
            .iter()
            .find(|r| {
                let role_ok = matches!(
                    (r.role, role),
                    (RoleMatch::Both, _)
                        | (RoleMatch::Client, Role::Client)
                        | (RoleMatch::Server, Role::Server)
                );
                role_ok
                    && glob(&r.program, program)
                    && r.net.is_none_or(|(net, len)| in_prefix(addr, net, len))
                    && (r.ports.0..=r.ports.1).contains(&port)
            })
            .map_or(self.default, |r| r.mode)
    }
}

fn parse_rule(line: &str) -> Result<Rule, String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 4 {
        return Err(format!(
            "expected 4 fields (mode role program address), got {}",
            f.len()
        ));
    }
    let mode = Mode::parse(f[0]).ok_or_else(|| format!("unknown mode {:?}", f[0]))?;
    let role = match f[1] {
        "client" => RoleMatch::Client,
        "server" => RoleMatch::Server,
        "both" => RoleMatch::Both,
        other => return Err(format!("unknown role {other:?} (client, server, both)")),
    };
    let (net, ports) = parse_target(f[3])?;
    Ok(Rule {
        mode,
        role,
        program: f[2].to_string(),
        net,
        ports,
    })
}

type Target = (Option<(IpAddr, u8)>, (u16, u16));

/// `*`, `ADDR`, `ADDR/LEN`, each optionally followed by `:PORT` or
/// `:LO-HI`; IPv6 addresses in brackets when a port follows.
fn parse_target(s: &str) -> Result<Target, String> {
    let (host, port): (std::borrow::Cow<'_, str>, Option<&str>) =
        if let Some(rest) = s.strip_prefix('[') {
            let (h, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("unclosed '[' in {s:?}"))?;
            // `[ADDR]/LEN:PORT` as well as `[ADDR/LEN]:PORT`.
            let (len, port) = match after.strip_prefix('/') {
                Some(l) => match l.split_once(':') {
                    Some((l, p)) => (Some(l), Some(p)),
                    None => (Some(l), None),
                },
                None => (None, after.strip_prefix(':')),
            };
            if port.is_none() && len.is_none() && !after.is_empty() {
                return Err(format!("unexpected {after:?} after ']' in {s:?}"));
            }
            match len {
                Some(l) => (format!("{h}/{l}").into(), port),
                None => (h.into(), port),
            }
        } else if s.matches(':').count() > 1 {
            (s.into(), None) // a bare IPv6 address
        } else {
            match s.split_once(':') {
                Some((h, p)) => (h.into(), Some(p)),
                None => (s.into(), None),
            }
        };
    let host = host.as_ref();
    let ports = match port {
        None | Some("*") => (0, u16::MAX),
        Some(p) => {
            let num = |x: &str| {
                x.parse::<u16>()
                    .map_err(|_| format!("bad port {x:?} in {s:?}"))
            };
            match p.split_once('-') {
                Some((lo, hi)) => (num(lo)?, num(hi)?),
                None => {
                    let n = num(p)?;
                    (n, n)
                }
            }
        }
    };
    if ports.0 > ports.1 {
        return Err(format!("empty port range in {s:?}"));
    }
    let net = if host == "*" {
        None
    } else {
        let (a, len) = match host.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (host, None),
        };
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("bad address {a:?} in {s:?}"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            Some(l) => l
                .parse::<u8>()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("bad prefix length {l:?} in {s:?}"))?,
            None => max,
        };
        Some((addr, len))
    };
    Ok((net, ports))
}

/// Whether `addr` is inside `net/len` (IPv4-mapped IPv6 addresses match
/// IPv4 networks).
fn in_prefix(addr: IpAddr, net: IpAddr, len: u8) -> bool {
    let addr = match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    };
    match (addr, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// Shell-style glob with `*` and `?`.
pub(crate) fn glob(pattern: &str, s: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), s.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// Receive buffers of a preloaded connection: the sockets crate's
/// default ring (64; it was 8). A bulk sender such as iperf3's client ran
/// out of credits every few messages with 8: each credit update (one per
/// four 64 KiB messages) made the sending process receive, and its engine
/// thread looped on the socket that then stayed readable (`softrdma-dm`:
/// 1.0-1.5 M system calls and 1.0-1.45 s of CPU per GB sent with
/// the engine on the protocol core). With 64 an update goes every 32 messages
/// (2 MiB) and the sender seldom waits: 23-70 k system calls and 0.22-0.34 s
/// per GB. The buffers are mapped lazily (a connection of small messages
/// touches a page per buffer), and a connection posts the ring beyond its
/// first 8 buffers only once it has received bulk data.
pub(crate) const RX_BUFS: u16 = softrdma_sockets::DEFAULT_RX_BUFS;

/// The sockets-direct settings of a preloaded connection.
pub(crate) fn stream_config() -> softrdma_sockets::Config {
    let mut c = softrdma_sockets::Config::with_mode(softrdma_sockets::Mode::Auto);
    c.rx_bufs = RX_BUFS;
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn first_matching_rule_decides_and_default_applies_otherwise() {
        let mut p = Policy::new(Mode::Auto);
        let errs = p.add_rules(
            "# comment\n\
             tcp both sshd *\n\
             offload client iperf3 127.0.0.1:5201\n\
             auto server * 0.0.0.0/0:6379   # redis\n\
             tcp client * 10.0.0.0/8\n",
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(p.decide("sshd", Role::Server, ip("1.2.3.4"), 22), Mode::Tcp);
        assert_eq!(
            p.decide("iperf3", Role::Client, ip("127.0.0.1"), 5201),
            Mode::Offload
        );
        assert_eq!(
            p.decide("iperf3", Role::Server, ip("127.0.0.1"), 5201),
            Mode::Auto
        );
        assert_eq!(
            p.decide("iperf3", Role::Client, ip("127.0.0.1"), 5202),
            Mode::Auto
        );
        assert_eq!(p.decide("nc", Role::Client, ip("10.9.8.7"), 80), Mode::Tcp);
        assert_eq!(
            p.decide("nc", Role::Client, ip("::ffff:10.9.8.7"), 80),
            Mode::Tcp,
            "IPv4-mapped addresses match IPv4 rules"
        );
        assert_eq!(p.decide("nc", Role::Client, ip("11.0.0.1"), 80), Mode::Auto);
    }

    #[test]
    fn bad_lines_are_reported_with_their_number() {
        let mut p = Policy::new(Mode::Tcp);
        let errs = p.add_rules("auto both x *\nfast both x *\nauto sideways x *\nauto both x 1.2.3.4/33\nauto both x *:9-8\nauto both x\n");
        let lines: Vec<usize> = errs.iter().map(|e| e.line).collect();
        assert_eq!(lines, [2, 3, 4, 5, 6]);
        assert!(errs[0].what.contains("unknown mode"));
    }

    #[test]
    fn ipv6_targets_and_port_ranges() {
        let mut p = Policy::new(Mode::Auto);
        assert!(
            p.add_rules("tcp both * [fe80::]/10:1000-2000\ntcp both * ::1\n")
                .is_empty()
        );
        assert_eq!(p.decide("a", Role::Client, ip("fe80::1"), 1500), Mode::Tcp);
        assert_eq!(p.decide("a", Role::Client, ip("fe80::1"), 2001), Mode::Auto);
        assert_eq!(p.decide("a", Role::Client, ip("::1"), 7), Mode::Tcp);
    }

    #[test]
    fn glob_matches_like_a_shell() {
        assert!(glob("*", ""));
        assert!(glob("redis-*", "redis-server"));
        assert!(glob("?c", "nc"));
        assert!(glob("*a*b*", "xxaxxbxx"));
        assert!(!glob("redis-*", "nginx"));
        assert!(!glob("a?", "a"));
    }

    #[test]
    fn modes_parse() {
        assert_eq!(Mode::parse("AUTO"), Some(Mode::Auto));
        assert_eq!(Mode::parse(" tcp "), Some(Mode::Tcp));
        assert_eq!(Mode::parse("offload"), Some(Mode::Offload));
        assert_eq!(Mode::parse("x"), None);
    }
}

#[cfg(test)]
mod ring_tests {
    use super::*;
    use softrdma_sockets::sdp::{AVAIL_LEN, Action, Message, Session};

    /// Credit updates per data message of a bulk stream into a reader that
    /// reads every message at once, with the preload's ring at both ends.
    fn updates_per_message(ring: u16) -> f64 {
        let size = stream_config().buf_size as u32;
        let mut tx = Session::new(ring, size, ring, size);
        let mut rx = Session::new(ring, size, ring, size);
        let (mut sent, mut updates) = (0u32, 0u32);
        let mut out = [0u8; AVAIL_LEN];
        while sent < 10_000 {
            let n = tx
                .header(&Message::Data { payload_len: 1000 }, &mut out)
                .expect("the writer never runs out of credits");
            sent += 1;
            match rx.receive_parts(&out[..n], n + 1000) {
                Ok(Action::Deliver { .. }) => rx.credits.on_repost(1),
                other => panic!("{other:?}"),
            }
            if rx.wants_credit_update() {
                updates += 1;
                let n = rx
                    .header(&Message::Data { payload_len: 0 }, &mut out)
                    .expect("credit");
                assert!(matches!(tx.receive(&out[..n]), Ok(Action::Repost)));
                tx.credits.on_repost(1);
            }
        }
        f64::from(updates) / f64::from(sent)
    }

    #[test]
    fn preloaded_connections_send_a_credit_update_per_half_ring() {
        let c = stream_config();
        assert_eq!(c.rx_bufs, RX_BUFS);
        // One update per half ring of messages (the earlier ring of 8: one
        // per four).
        let per = updates_per_message(c.rx_bufs);
        assert!(per <= 1.0 / 30.0, "{per}");
        assert!(updates_per_message(8) >= 1.0 / 4.5);
        // Lazily mapped, but bounded: the ring and the send buffers.
        assert!(c.buffer_memory() <= 5 << 20, "{}", c.buffer_memory());
    }
}
