//! Connecting two local QPs over a loopback TCP connection, with the MPA
//! exchange done by the shared handshake driver ([`crate::handshake`]). For tests, benchmarks and the demo;
//! applications use the connection manager.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::Duration;

use softrdma_proto::mpa::MpaConfig;

use crate::connect::ConnectError;
use crate::handshake::{Answer, Handshake, Outcome, Stage, Step};
use crate::qp::{EstablishError, LinkParams, QueuePair};
use crate::sys::clock;
use crate::sys::wait::wait_ready;

/// Why [`connect_pair`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectPairError {
    /// Socket setup failed.
    #[error("loopback socket: {0}")]
    Io(#[from] std::io::Error),
    /// The MPA exchange failed.
    #[error("MPA exchange: {0}")]
    Mpa(#[from] ConnectError),
    /// A QP refused the connection.
    #[error("{0}")]
    Establish(#[from] EstablishError),
    /// The accepting side failed (kept for compatibility: the accepting
    /// side no longer runs on a thread of its own).
    #[error("the accepting side failed")]
    Accept,
}

/// Connects `initiator` to `responder` over 127.0.0.1 with `config` (its
/// IRD/ORD are replaced by each QP's own) and moves both to RTS. Both
/// handshakes run in the calling thread (the shared non-blocking driver of
/// [`crate::handshake`], both ends advanced in turn); no thread is
/// started.
pub fn connect_pair(
    initiator: &QueuePair,
    responder: &QueuePair,
    config: &MpaConfig,
) -> Result<(), ConnectPairError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    let timeout = Duration::from_secs(10);
    let mut rcfg = config.clone();
    let ra = responder.query();
    rcfg.ird = ra.ird;
    rcfg.ord = ra.ord;
    let mut icfg = config.clone();
    let ia = initiator.query();
    icfg.ird = ia.ird;
    icfg.ord = ia.ord;
    let mut hi = Handshake::initiator(icfg, &[]).map_err(ConnectError::from)?;
    let answer = Answer::Accept {
        private_data: Vec::new(),
        ird: rcfg.ird,
        ord: rcfg.ord,
    };
    let mut hr = Handshake::responder(rcfg, answer).map_err(ConnectError::from)?;
    let mut s = TcpStream::connect(addr)?;
    let (mut rs, _) = listener.accept()?;
    for st in [&s, &rs] {
        st.set_nodelay(true)?;
        st.set_nonblocking(true)?;
    }
    let deadline = clock::now() + timeout;
    let (mut n, mut rn) = (None, None);
    while n.is_none() || rn.is_none() {
        let mut waiting = None;
        if n.is_none() {
            match hi.advance(&mut s).map_err(ConnectError::from)? {
                Step::Done(Outcome::Established(x)) => n = Some(x),
                Step::Done(_) => {
                    return Err(ConnectError::PeerClosed {
                        stage: Stage::Reply,
                    }
                    .into());
                }
                Step::Wait(r) => waiting = Some((s.as_fd(), r)),
            }
        }
        if rn.is_none() {
            match hr.advance(&mut rs).map_err(ConnectError::from)? {
                Step::Done(Outcome::Established(x)) => rn = Some(x),
                Step::Done(_) => {
                    return Err(ConnectError::PeerClosed {
                        stage: Stage::Request,
                    }
                    .into());
                }
                Step::Wait(r) => waiting = waiting.or(Some((rs.as_fd(), r))),
            }
        }
        if n.is_some() && rn.is_some() {
            break;
        }
        if clock::now() >= deadline {
            return Err(ConnectError::TimedOut {
                stage: Stage::Reply,
                after: timeout,
            }
            .into());
        }
        if let Some((fd, r)) = waiting {
            // Short waits: the other end may be the one with news.
            wait_ready(fd, r, Duration::from_millis(1))?;
        }
    }
    let (Some(n), Some(rn)) = (n, rn) else {
        return Err(ConnectError::TimedOut {
            stage: Stage::Reply,
            after: timeout,
        }
        .into());
    };
    initiator.establish(s, &LinkParams::from(&n))?;
    responder.establish(rs, &LinkParams::from(&rn))?;
    Ok(())
}
