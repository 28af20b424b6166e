//! Why a connection ended, in words: the device's asynchronous events of a
//! QP (a Terminate received or sent, an orderly close, a reset) turned
//! into the sentence an error message needs instead of a bare
//! `IBV_WC_WR_FLUSH_ERR`.

use softrdma_engine::{AsyncEvent, AsyncEventKind, Device};

/// Why QP `qp_num` of `dev` left RTS, from the events queued for it (the
/// events of other QPs are left out). `None` when the engine reported
/// nothing (yet).
pub(crate) fn connection_end(dev: &Device, qp_num: u32) -> Option<String> {
    let mut why = None;
    while let Some(e) = dev.async_events().try_get() {
        if e.qp_num == Some(qp_num)
            && let Some(w) = describe(&e)
        {
            // The first cause is the one that matters.
            why.get_or_insert(w);
        }
    }
    why
}

fn describe(e: &AsyncEvent) -> Option<String> {
    let detail = e
        .detail
        .as_deref()
        .map_or(String::new(), |d| format!(": {d}"));
    let term = e.term.map_or(String::new(), |t| format!(" ({t})"));
    Some(match e.kind {
        AsyncEventKind::TerminateReceived => {
            format!("the peer ended the connection with a Terminate{term}{detail}")
        }
        AsyncEventKind::LlpClosed => "the peer closed the connection".into(),
        AsyncEventKind::LlpReset => "the connection was reset (the peer left)".into(),
        AsyncEventKind::BadClose => {
            "the peer closed the connection in the middle of a message or with work outstanding"
                .into()
        }
        AsyncEventKind::QpRequestError
        | AsyncEventKind::QpAccessError
        | AsyncEventKind::QpFatal => {
            format!(
                "this side ended the connection with a Terminate{term} because of the peer's \
                 {}{detail}",
                match e.kind {
                    AsyncEventKind::QpAccessError => "access to memory it was not granted",
                    AsyncEventKind::QpRequestError => "invalid request",
                    _ => "error",
                }
            )
        }
        _ => return None,
    })
}
