//! Connecting two local QPs over a loopback TCP connection, with the MPA
//! exchange done by [`crate::connect`]. For tests, benchmarks and the demo;
//! applications use the connection manager.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::Duration;

use softrdma_proto::mpa::MpaConfig;

use crate::connect::{ConnectError, mpa_accept, mpa_connect};
use crate::qp::{EstablishError, LinkParams, QueuePair};

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
    /// The accepting thread panicked.
    #[error("the accepting side failed")]
    Accept,
}

/// Connects `initiator` to `responder` over 127.0.0.1 with `config` (its
/// IRD/ORD are replaced by each QP's own) and moves both to RTS.
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
    let accept = std::thread::spawn(move || -> Result<(TcpStream, _), ConnectPairError> {
        let (mut s, _) = listener.accept()?;
        let n = mpa_accept(&mut s, &rcfg, &[], timeout)?;
        Ok((s, n))
    });
    let mut icfg = config.clone();
    let ia = initiator.query();
    icfg.ird = ia.ird;
    icfg.ord = ia.ord;
    let mut s = TcpStream::connect(addr)?;
    let n = mpa_connect(&mut s, &icfg, &[], timeout);
    let (rs, rn) = accept.join().map_err(|_| ConnectPairError::Accept)??;
    let n = n?;
    initiator.establish(s, &LinkParams::from(&n))?;
    responder.establish(rs, &LinkParams::from(&rn))?;
    Ok(())
}
