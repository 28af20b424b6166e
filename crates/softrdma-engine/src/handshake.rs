//! The one MPA handshake driver: runs the sans-IO machines of
//! [`softrdma_proto::mpa`] over a non-blocking [`TcpStream`].
//!
//! Every way a connection enters full operation goes through it: the
//! connection manager's connects and accepts ([`crate::cm`], driven by its
//! reactor thread or, for the blocking calls, by the caller's thread), the
//! stream helpers of [`crate::connect`], and the stream-to-RDMA switch of
//! [`crate::transition`]. The driver never blocks: `Handshake::advance`
//! does all it can with what the socket has and says which readiness it
//! waits for; `drive_blocking` loops over it with `poll(2)` and a
//! deadline for the blocking calls.
//!
//! It reads exactly the octets of the handshake (the machines say how many
//! they want), so when it finishes the next octet read from the socket is
//! the first octet of full operation. Octets already read from the socket
//! by the caller (a read-ahead buffer) are given with
//! `Handshake::with_prefix` and consumed first; what the handshake does
//! not use is handed back by `Handshake::take_prefix_rest`.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::Duration;

use softrdma_proto::mpa::{
    ConfigError, Initiator, InitiatorEvent, MpaConfig, MpaNegotiationError, Negotiated, Request,
    Responder, ResponderEvent,
};
use softrdma_proto::wire::mpa::{HEADER_LEN, MPA_MAX_PRIVATE_DATA, MpaError};

use crate::sys::clock;
use crate::sys::wait::{Readiness, wait_ready};

/// Largest read the driver does at a time (a frame, or an RTR FPDU).
const RX_CHUNK: usize = HEADER_LEN + MPA_MAX_PRIVATE_DATA;

/// What a handshake waits for when it fails or times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// The initiator waits for the MPA Reply.
    Reply,
    /// The responder waits for the MPA Request.
    Request,
    /// The responder waits for the peer-to-peer RTR.
    Rtr,
    /// The initiator waits for the response to its Read RTR.
    ReadResponse,
    /// The application has not answered the Request yet.
    Answer,
    /// Sending the last frame (reject, Reply, RTR).
    Sending,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Reply => "MPA reply",
            Stage::Request => "MPA request",
            Stage::Rtr => "RTR (ready-to-receive) message",
            Stage::ReadResponse => "response to the RTR Read",
            Stage::Answer => "answer from the application",
            Stage::Sending => "room in the socket to send the handshake",
        })
    }
}

/// Seconds for error texts: "30 s", "0.2 s".
pub(crate) struct Secs(pub(crate) Duration);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(1000) {
            write!(f, "{} s", ms / 1000)
        } else {
            write!(f, "{} s", self.0.as_secs_f64())
        }
    }
}

/// Why a handshake failed, naming the cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The local settings or private data cannot be used.
    #[error("MPA settings: {0}")]
    Config(#[from] ConfigError),
    /// The peer's MPA frames are wrong or refuse this side's terms.
    #[error("{}", describe_negotiation(.0))]
    Negotiation(#[from] MpaNegotiationError),
    /// The peer rejected the connection; `private_data` is the reject's
    /// private data (often a reason in text).
    #[error("rejected: {}", describe_reject(private_data))]
    Rejected {
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// Nothing (or not enough) arrived before the deadline.
    #[error("TCP connected but no {stage} within {}", Secs(*after))]
    TimedOut {
        /// What was missing.
        stage: Stage,
        /// The time allowed.
        after: Duration,
    },
    /// The peer closed (or reset) the connection during the handshake.
    #[error("the peer closed the connection (while waiting for the {stage})")]
    PeerClosed {
        /// What was expected.
        stage: Stage,
    },
    /// A socket error.
    #[error("socket: {0}")]
    Io(io::Error),
}

impl HandshakeError {
    /// Whether the error is a timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, HandshakeError::TimedOut { .. })
    }

    /// Whether the peer is not an MPA endpoint at all (it sent something
    /// that does not start with an MPA key: text, garbage).
    pub fn is_not_mpa(&self) -> bool {
        matches!(
            self,
            HandshakeError::Negotiation(MpaNegotiationError::Frame(MpaError::BadKey { .. }))
        )
    }
}

/// Describes a peer that is not an MPA endpoint from its first octets.
fn describe_not_mpa(key: &[u8]) -> String {
    let text: String = key
        .iter()
        .take_while(|&&b| b.is_ascii_graphic() || b == b' ')
        .map(|&b| char::from(b))
        .collect();
    let text = text.trim_end();
    if text.len() >= 3 {
        format!("it answered with text starting `{text}`")
    } else {
        let hex: Vec<String> = key.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("it sent binary octets {}", hex.join(" "))
    }
}

/// A negotiation error without doubled prefixes; a bad key is described as
/// a peer that is not an MPA endpoint.
pub(crate) fn describe_negotiation(e: &MpaNegotiationError) -> String {
    match e {
        MpaNegotiationError::Frame(MpaError::BadKey { key }) => {
            let n = key.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
            format!(
                "the peer is not an iWARP/MPA endpoint: {}",
                describe_not_mpa(key.get(..n).unwrap_or_default())
            )
        }
        other => other.to_string(),
    }
}

/// A reject's private data as the reason text it usually is.
pub(crate) fn describe_reject(private_data: &[u8]) -> String {
    if private_data.is_empty() {
        return "the peer gave no reason (no private data)".into();
    }
    match std::str::from_utf8(private_data) {
        Ok(s) if s.chars().all(|c| !c.is_control() || c == '\n') => {
            format!("\"{}\"", s.trim_end_matches('\0'))
        }
        _ => format!("{} octets of private data", private_data.len()),
    }
}

impl HandshakeError {
    fn from_io(e: io::Error, stage: Stage) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => HandshakeError::PeerClosed { stage },
            _ => HandshakeError::Io(e),
        }
    }
}

/// How the responder answers the Request when it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Stop and report the Request ([`Outcome::Request`]); the caller
    /// answers later with [`Handshake::answer`].
    Hold,
    /// Accept with this private data and IRD/ORD.
    Accept {
        /// Private data of the Reply.
        private_data: Vec<u8>,
        /// This side's IRD.
        ird: u16,
        /// This side's ORD.
        ord: u16,
    },
    /// Reject with this private data.
    Reject(Vec<u8>),
}

/// Where a handshake ended (or paused, for [`Answer::Hold`]).
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The Request arrived and waits for [`Handshake::answer`].
    Request(Request),
    /// Full operation: everything to send is written.
    Established(Negotiated),
    /// The reject was written (responder); the Request it answered.
    RejectSent(Option<Request>),
}

/// What `Handshake::advance` says.
#[derive(Debug)]
pub(crate) enum Step {
    /// Call again once the socket has this readiness.
    Wait(Readiness),
    /// Finished (or paused at the Request).
    Done(Outcome),
}

#[derive(Debug)]
enum Machine {
    I(Initiator),
    R(Responder),
}

/// One handshake in progress (see the [module documentation](self)).
#[derive(Debug)]
pub(crate) struct Handshake {
    m: Machine,
    answer: Answer,
    /// The Request while it waits for an answer.
    request: Option<Request>,
    answered: bool,
    rejecting: bool,
    prefix: Vec<u8>,
    ppos: usize,
    done: Option<Negotiated>,
    /// Octets received from the peer so far.
    received: usize,
    /// Reads take what the socket has (not just what the handshake
    /// wants); octets past the handshake are kept with the prefix's rest
    /// ([`take_prefix_rest`](Self::take_prefix_rest)).
    read_ahead: bool,
}

impl Handshake {
    /// The initiator: the Request carrying `private_data` is queued.
    pub(crate) fn initiator(config: MpaConfig, private_data: &[u8]) -> Result<Self, ConfigError> {
        Ok(Self::new(
            Machine::I(Initiator::new(config, private_data)?),
            Answer::Hold,
        ))
    }

    /// The responder, answering the Request as `answer` says.
    pub(crate) fn responder(config: MpaConfig, answer: Answer) -> Result<Self, ConfigError> {
        Ok(Self::new(Machine::R(Responder::new(config)?), answer))
    }

    fn new(m: Machine, answer: Answer) -> Self {
        Handshake {
            m,
            answer,
            request: None,
            answered: false,
            rejecting: false,
            prefix: Vec::new(),
            ppos: 0,
            done: None,
            received: 0,
            read_ahead: false,
        }
    }

    /// Reads take what the socket has, up to one frame of the largest
    /// size, instead of what the handshake needs next (a header and its
    /// private data in one read, not two): for a caller that takes the
    /// octets past the handshake with
    /// [`take_prefix_rest`](Self::take_prefix_rest) (at most one frame's
    /// worth).
    pub(crate) fn reading_ahead(mut self) -> Self {
        self.read_ahead = true;
        self
    }

    /// Octets already read from the socket, to be consumed first.
    pub(crate) fn with_prefix(mut self, prefix: Vec<u8>) -> Self {
        self.prefix = prefix;
        self.ppos = 0;
        self
    }

    /// The prefix octets the handshake did not consume (with
    /// [`reading_ahead`](Self::reading_ahead), also those it read past
    /// its end).
    pub(crate) fn take_prefix_rest(&mut self) -> Vec<u8> {
        let rest = self.prefix.get(self.ppos..).unwrap_or_default().to_vec();
        self.prefix = Vec::new();
        self.ppos = 0;
        rest
    }

    /// Octets of the handshake received from the peer so far (0: a silent
    /// peer); octets read past its end are not counted.
    pub(crate) fn received(&self) -> usize {
        self.received
    }

    /// Answers a held Request. Private data over the cap is refused here
    /// and nothing is queued.
    pub(crate) fn answer(&mut self, answer: Answer) -> Result<(), ConfigError> {
        let Machine::R(r) = &mut self.m else {
            return Err(ConfigError::NotAwaitingAnswer);
        };
        match &answer {
            Answer::Hold => return Ok(()),
            Answer::Accept {
                private_data,
                ird,
                ord,
            } => r.accept(private_data, *ird, *ord)?,
            Answer::Reject(pd) => {
                r.reject(pd)?;
                self.rejecting = true;
            }
        }
        self.answered = true;
        self.answer = answer;
        Ok(())
    }

    /// What the handshake waits for now (for error texts).
    pub(crate) fn stage(&self) -> Stage {
        match &self.m {
            Machine::I(_) => {
                if self.done.is_some() {
                    Stage::Sending
                } else {
                    Stage::Reply
                }
            }
            Machine::R(r) => {
                if self.request.is_none() {
                    Stage::Request
                } else if !self.answered {
                    Stage::Answer
                } else if !r.transmit().is_empty() || self.rejecting {
                    Stage::Sending
                } else {
                    Stage::Rtr
                }
            }
        }
    }

    /// The error for a deadline of `after` that passed.
    pub(crate) fn timed_out(&self, after: Duration) -> HandshakeError {
        HandshakeError::TimedOut {
            stage: self.stage(),
            after,
        }
    }

    fn transmit(&self) -> &[u8] {
        match &self.m {
            Machine::I(m) => m.transmit(),
            Machine::R(m) => m.transmit(),
        }
    }

    fn consumed(&mut self, n: usize) {
        match &mut self.m {
            Machine::I(m) => m.consumed(n),
            Machine::R(m) => m.consumed(n),
        }
    }

    fn want(&self) -> usize {
        match &self.m {
            Machine::I(m) => m.want(),
            Machine::R(m) => m.want(),
        }
    }

    /// Writes what can be written; `None` if the socket is full, else
    /// whether anything was written.
    fn flush(&mut self, stream: &mut TcpStream) -> Result<Option<bool>, HandshakeError> {
        let mut wrote = false;
        loop {
            let out = self.transmit();
            if out.is_empty() {
                return Ok(Some(wrote));
            }
            match stream.write(out) {
                Ok(0) => {
                    return Err(HandshakeError::PeerClosed {
                        stage: self.stage(),
                    });
                }
                Ok(n) => {
                    wrote = true;
                    self.consumed(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(HandshakeError::from_io(e, self.stage())),
            }
        }
    }

    /// Does all it can without blocking (`stream` must be non-blocking,
    /// except for a handshake that only feeds on its prefix).
    pub(crate) fn advance(&mut self, stream: &mut TcpStream) -> Result<Step, HandshakeError> {
        let mut buf = [0u8; RX_CHUNK];
        loop {
            let Some(wrote) = self.flush(stream)? else {
                return Ok(Step::Wait(Readiness::Write));
            };
            if let Some(n) = self.done.take() {
                return Ok(Step::Done(Outcome::Established(n)));
            }
            match &mut self.m {
                Machine::I(i) => match i.poll() {
                    Some(InitiatorEvent::Established(n)) => {
                        self.done = Some(n);
                        continue;
                    }
                    Some(InitiatorEvent::Rejected { private_data, .. }) => {
                        return Err(HandshakeError::Rejected { private_data });
                    }
                    _ => {}
                },
                Machine::R(r) => match r.poll() {
                    Some(ResponderEvent::Request(req)) => {
                        self.request = Some(req.clone());
                        match self.answer.clone() {
                            Answer::Hold => return Ok(Step::Done(Outcome::Request(req))),
                            a => self.answer(a)?,
                        }
                        continue;
                    }
                    Some(ResponderEvent::Established(n)) => {
                        self.done = Some(n);
                        continue;
                    }
                    _ => {}
                },
            }
            if let Machine::R(r) = &self.m {
                if self.rejecting && r.is_over() {
                    return Ok(Step::Done(Outcome::RejectSent(self.request.take())));
                }
                if self.request.is_some() && !self.answered {
                    // Held: nothing to do until answered.
                    return Ok(Step::Wait(Readiness::Read));
                }
            }
            let want = self.want();
            if want == 0 {
                return Err(MpaNegotiationError::Over.into());
            }
            let from_prefix = self.ppos < self.prefix.len();
            if wrote && !from_prefix && matches!(self.m, Machine::I(_)) {
                // The initiator just sent what the responder answers: the
                // answer is a round trip away, so no read now (it would
                // find nothing: one system call less); the caller waits
                // for the socket to be readable.
                return Ok(Step::Wait(Readiness::Read));
            }
            let r = if from_prefix {
                let avail = self.prefix.get(self.ppos..).unwrap_or_default();
                let r = self.receive(avail.to_vec().as_slice());
                if let Ok(n) = r {
                    if n == 0 {
                        return Err(MpaNegotiationError::Over.into());
                    }
                    self.ppos += n;
                }
                r
            } else {
                let ask = if self.read_ahead {
                    RX_CHUNK
                } else {
                    want.clamp(1, RX_CHUNK)
                };
                let dst = buf.get_mut(..ask).unwrap_or_default();
                let n = match stream.read(dst) {
                    Ok(0) => {
                        return Err(HandshakeError::PeerClosed {
                            stage: self.stage(),
                        });
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        return Ok(Step::Wait(Readiness::Read));
                    }
                    Err(e) => return Err(HandshakeError::from_io(e, self.stage())),
                };
                let got = buf.get(..n).unwrap_or_default().to_vec();
                let r = self.receive(&got);
                if let Ok(used) = r
                    && used < got.len()
                {
                    // Read ahead: the rest is consumed from the prefix
                    // (empty here: it is read before the socket), and
                    // what the handshake does not take is handed back.
                    self.prefix = got.get(used..).unwrap_or_default().to_vec();
                    self.ppos = 0;
                }
                r
            };
            if let Err(e) = r {
                if let Machine::R(m) = &mut self.m
                    && m.request().is_some()
                    && m.reject(&[]).is_ok()
                {
                    // Best effort: the error is what the caller needs.
                    let _ = self.flush(stream);
                }
                return Err(HandshakeError::Negotiation(e));
            }
        }
    }

    /// Feeds the machine; counts the octets it took (those read ahead
    /// past the handshake are counted when it takes them from the rest,
    /// not twice), or all of them if it refused them.
    fn receive(&mut self, bytes: &[u8]) -> Result<usize, MpaNegotiationError> {
        let r = match &mut self.m {
            Machine::I(m) => m.receive(bytes),
            Machine::R(m) => m.receive(bytes),
        };
        self.received += match r {
            Ok(n) => n,
            Err(_) => bytes.len(),
        };
        r
    }
}

/// Runs `hs` over `stream` until done, waiting with `poll(2)`, for at most
/// `timeout`. The stream is left non-blocking.
pub(crate) fn drive_blocking(
    hs: &mut Handshake,
    stream: &mut TcpStream,
    timeout: Duration,
) -> Result<Outcome, HandshakeError> {
    let start = clock::now();
    let deadline = start.checked_add(timeout);
    stream.set_nonblocking(true).map_err(HandshakeError::Io)?;
    loop {
        match hs.advance(stream)? {
            Step::Done(o) => return Ok(o),
            Step::Wait(r) => {
                let left = match deadline {
                    Some(d) => d.saturating_duration_since(clock::now()),
                    None => Duration::from_secs(86_400),
                };
                if left.is_zero() {
                    return Err(hs.timed_out(timeout));
                }
                wait_ready(stream.as_fd(), r, left).map_err(HandshakeError::Io)?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, TcpListener};

    use super::*;

    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    #[test]
    fn texts_name_the_cause() {
        assert_eq!(Secs(Duration::from_secs(30)).to_string(), "30 s");
        assert_eq!(Secs(Duration::from_millis(200)).to_string(), "0.2 s");
        assert_eq!(describe_reject(b"server full"), "\"server full\"");
        assert_eq!(describe_reject(&[0xff, 0, 1]), "3 octets of private data");
        assert!(describe_reject(b"").contains("no reason"));
        let mut key = [0u8; 16];
        key.copy_from_slice(b"HTTP/1.0 200 OK\r");
        let e = MpaNegotiationError::Frame(MpaError::BadKey { key });
        assert_eq!(
            describe_negotiation(&e),
            "the peer is not an iWARP/MPA endpoint: it answered with text starting `HTTP/1.0 200 OK`"
        );
        let e = HandshakeError::Negotiation(MpaNegotiationError::Frame(MpaError::BadKey {
            key: [0xa5; 16],
        }));
        assert!(e.is_not_mpa());
        assert!(e.to_string().contains("binary octets a5 a5"), "{e}");
        let e = HandshakeError::TimedOut {
            stage: Stage::Reply,
            after: Duration::from_secs(30),
        };
        assert_eq!(e.to_string(), "TCP connected but no MPA reply within 30 s");
    }

    #[test]
    fn prefix_is_consumed_first_and_the_rest_handed_back() {
        let (mut a, mut b) = tcp_pair();
        let mut init = Initiator::new(MpaConfig::default(), b"hi").unwrap();
        let mut prefix = init.transmit().to_vec();
        init.consumed(prefix.len());
        prefix.extend_from_slice(b"FPDU");
        let mut hs = Handshake::responder(MpaConfig::default(), Answer::Hold)
            .unwrap()
            .with_prefix(prefix);
        // The whole Request is in the prefix: no socket read needed.
        let Ok(Step::Done(Outcome::Request(r))) = hs.advance(&mut b) else {
            panic!("no request");
        };
        assert_eq!(r.private_data, b"hi");
        assert_eq!(hs.stage(), Stage::Answer);
        hs.answer(Answer::Accept {
            private_data: b"ok".to_vec(),
            ird: 4,
            ord: 4,
        })
        .unwrap();
        let Ok(Step::Done(Outcome::Established(n))) = hs.advance(&mut b) else {
            panic!("not established");
        };
        assert_eq!(n.peer_private_data, b"hi");
        assert_eq!(hs.take_prefix_rest(), b"FPDU");
        // The Reply went out on the socket.
        let mut reply = [0u8; 64];
        let got = drive_read(&mut a, &mut reply);
        assert!(got >= 20);
        assert_eq!(&reply[..16], b"MPA ID Rep Frame");
    }

    /// Reading ahead, the Request (header and private data) comes in one
    /// read, and the octets that followed it on the socket are handed back
    /// with the prefix's rest, not lost.
    #[test]
    fn a_read_ahead_hands_back_what_it_read_past_the_handshake() {
        let (mut a, mut b) = tcp_pair();
        let mut init = Initiator::new(MpaConfig::default(), b"hello").unwrap();
        let mut wire = init.transmit().to_vec();
        init.consumed(wire.len());
        wire.extend_from_slice(b"FPDU");
        a.write_all(&wire).unwrap();
        let mut hs = Handshake::responder(
            MpaConfig::default(),
            Answer::Accept {
                private_data: b"ok".to_vec(),
                ird: 4,
                ord: 4,
            },
        )
        .unwrap()
        .reading_ahead();
        let n = loop {
            match hs.advance(&mut b).unwrap() {
                Step::Done(Outcome::Established(n)) => break n,
                Step::Wait(r) => {
                    wait_ready(b.as_fd(), r, Duration::from_secs(10)).unwrap();
                }
                Step::Done(o) => panic!("{o:?}"),
            }
        };
        assert_eq!(n.peer_private_data, b"hello");
        assert_eq!(hs.take_prefix_rest(), b"FPDU");
        let mut reply = [0u8; 64];
        assert!(drive_read(&mut a, &mut reply) >= 20);
        assert_eq!(&reply[..16], b"MPA ID Rep Frame");
    }

    /// The initiator does not read right after sending its Request (the
    /// Reply is a round trip away): it waits for the socket, and reads the
    /// Reply once it is there.
    #[test]
    fn the_initiator_waits_for_the_reply_before_reading() {
        let (mut a, mut b) = tcp_pair();
        // The Reply is in the initiator's socket before it sends the
        // Request (made by a responder fed with the same Request): a
        // read after the send would find it, and a test that only looked
        // for `Wait(Read)` could not tell a read that found nothing from
        // no read.
        let init = Initiator::new(MpaConfig::default(), b"").unwrap();
        let mut resp = Responder::new(MpaConfig::default()).unwrap();
        let request = init.transmit().to_vec();
        assert_eq!(resp.receive(&request).unwrap(), request.len());
        assert!(matches!(resp.poll(), Some(ResponderEvent::Request(_))));
        resp.accept(&[], 4, 4).unwrap();
        let reply = resp.transmit().to_vec();
        b.write_all(&reply).unwrap();
        wait_ready(a.as_fd(), Readiness::Read, Duration::from_secs(5)).unwrap();
        let mut hs = Handshake::initiator(MpaConfig::default(), b"").unwrap();
        assert!(matches!(
            hs.advance(&mut a),
            Ok(Step::Wait(Readiness::Read))
        ));
        assert_eq!(hs.received(), 0, "the initiator read right after sending");
        // The next advance (the socket is readable) reads the Reply.
        let out = drive_blocking(&mut hs, &mut a, Duration::from_secs(10)).unwrap();
        assert!(matches!(out, Outcome::Established(_)), "{out:?}");
        assert_eq!(hs.received(), reply.len());
        let mut got = vec![0u8; request.len()];
        b.set_nonblocking(false).unwrap();
        b.read_exact(&mut got).unwrap();
        assert_eq!(got, request);
    }

    /// With read-ahead, octets read past the handshake were counted as
    /// received twice: when read, and again when taken from the rest.
    #[test]
    fn octets_read_ahead_are_counted_once() {
        let (mut a, mut b) = tcp_pair();
        let mut init = Initiator::new(MpaConfig::default(), b"").unwrap();
        let request = init.transmit().to_vec();
        init.consumed(request.len());
        let mut hs = Handshake::responder(
            MpaConfig::default(),
            Answer::Accept {
                private_data: Vec::new(),
                ird: 4,
                ord: 4,
            },
        )
        .unwrap()
        .reading_ahead();
        // The Request and 8 octets of full operation, in one read.
        let mut wire = request.clone();
        wire.extend_from_slice(b"FPDU1234");
        a.write_all(&wire).unwrap();
        wait_ready(b.as_fd(), Readiness::Read, Duration::from_secs(5)).unwrap();
        let out = drive_blocking(&mut hs, &mut b, Duration::from_secs(10)).unwrap();
        assert!(matches!(out, Outcome::Established(_)), "{out:?}");
        assert_eq!(hs.take_prefix_rest(), b"FPDU1234");
        assert_eq!(hs.received(), request.len());
    }

    #[test]
    fn a_silent_peer_leaves_the_driver_waiting_to_read() {
        let (mut a, _b) = tcp_pair();
        let mut hs = Handshake::initiator(MpaConfig::default(), b"").unwrap();
        assert!(matches!(
            hs.advance(&mut a),
            Ok(Step::Wait(Readiness::Read))
        ));
        assert_eq!(hs.received(), 0);
        let e = drive_blocking(&mut hs, &mut a, Duration::from_millis(50)).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert_eq!(
            e.to_string(),
            "TCP connected but no MPA reply within 0.05 s"
        );
    }

    fn drive_read(s: &mut TcpStream, buf: &mut [u8]) -> usize {
        wait_ready(s.as_fd(), Readiness::Read, Duration::from_secs(5)).unwrap();
        s.read(buf).unwrap()
    }
}
