//! The umbrella error type.

/// Any error of the engine's operations.
///
/// Each operation returns its own small error enum (so a `match` sees only
/// what that operation can fail with); every one of them converts into
/// `Error` with `?`, for code that just wants to propagate:
///
/// ```no_run
/// use softrdma_engine::{Access, Device};
///
/// fn setup() -> Result<(), softrdma_engine::Error> {
///     let dev = Device::open_default()?; // OpenError
///     let pd = dev.alloc_pd();
///     let _mr = pd.register(4096, Access::LOCAL_WRITE)?; // RegError
///     Ok(())
/// }
/// ```
///
/// The operation's own error is the variant's field.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Opening the device.
    #[error(transparent)]
    OpenDevice(#[from] crate::device::OpenError),
    /// Creating a completion queue.
    #[error(transparent)]
    CreateCq(#[from] crate::cq::CreateCqError),
    /// Arming a completion queue.
    #[error(transparent)]
    Notify(#[from] crate::cq::NotifyError),
    /// Resizing a completion queue.
    #[error(transparent)]
    ResizeCq(#[from] crate::cq::ResizeError),
    /// Reading a completion channel.
    #[error(transparent)]
    GetEvent(#[from] crate::cq::GetEventError),
    /// Registering memory.
    #[error(transparent)]
    Reg(#[from] crate::mr::RegError),
    /// Deregistering memory.
    #[error(transparent)]
    Dereg(#[from] crate::mr::DeregError),
    /// A range outside a region.
    #[error(transparent)]
    Range(#[from] crate::mr::RangeError),
    /// A remote access refused.
    #[error(transparent)]
    RemoteAccess(#[from] crate::mr::RemoteAccessError),
    /// A local access refused.
    #[error(transparent)]
    LocalAccess(#[from] crate::mr::LocalAccessError),
    /// Invalidating an STag.
    #[error(transparent)]
    Invalidate(#[from] crate::mr::InvalidateError),
    /// Binding a memory window.
    #[error(transparent)]
    Bind(#[from] crate::mr::BindError),
    /// A fast registration.
    #[error(transparent)]
    FastReg(#[from] crate::mr::FastRegError),
    /// Creating a queue pair.
    #[error(transparent)]
    CreateQp(#[from] crate::qp::CreateQpError),
    /// Posting a send request.
    #[error(transparent)]
    PostSend(#[from] crate::qp::PostSendError),
    /// Posting a list of send requests.
    #[error(transparent)]
    PostSendList(#[from] crate::qp::PostSendListError),
    /// Posting a receive on a queue pair.
    #[error(transparent)]
    PostRecv(#[from] crate::qp::PostRecvError),
    /// Modifying a queue pair.
    #[error(transparent)]
    Modify(#[from] crate::qp::ModifyError),
    /// Attaching a connected stream to a queue pair.
    #[error(transparent)]
    Establish(#[from] crate::qp::EstablishError),
    /// Creating a shared receive queue.
    #[error(transparent)]
    CreateSrq(#[from] crate::srq::CreateSrqError),
    /// Posting a receive on a shared receive queue.
    #[error(transparent)]
    SrqPostRecv(#[from] crate::srq::PostRecvError),
    /// Modifying a shared receive queue.
    #[error(transparent)]
    ModifySrq(#[from] crate::srq::ModifySrqError),
    /// Connecting (blocking connect).
    #[error(transparent)]
    Connect(#[from] crate::connect::ConnectError),
    /// MPA negotiation.
    #[error(transparent)]
    Handshake(#[from] crate::handshake::HandshakeError),
    /// The connection manager.
    #[error(transparent)]
    Cm(#[from] crate::cm::CmError),
    /// The stream-to-RDMA transition.
    #[error(transparent)]
    Transition(#[from] crate::transition::TransitionError),
    /// Connecting a loopback pair.
    #[error(transparent)]
    ConnectPair(#[from] crate::loopback::ConnectPairError),
    /// Decoding a remote-buffer descriptor.
    #[error(transparent)]
    RemoteBuf(#[from] crate::remote::RemoteBufError),
    /// Proxy memory.
    #[error(transparent)]
    ProxyMem(#[from] crate::proxy::ProxyMemError),
    /// A proxy message handler.
    #[error(transparent)]
    ProxyHandler(#[from] crate::proxy::HandlerError),
    /// Setting up a proxy QP.
    #[error(transparent)]
    ProxySetup(#[from] crate::proxy::ProxySetupError),
    /// The tokio adapter's completion queue.
    #[cfg(feature = "tokio")]
    #[error(transparent)]
    AsyncCq(#[from] crate::async_cq::AsyncCqError),
    /// Posting through the tokio adapter.
    #[cfg(feature = "tokio")]
    #[error(transparent)]
    AsyncPost(#[from] crate::async_cq::PostError),
    /// An operating-system error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::Error;
    use crate::qp::{PostSendError, PostSendListError};

    fn list() -> Result<(), PostSendListError> {
        Err(PostSendListError {
            index: 2,
            error: PostSendError::QueueFull { depth: 4 },
        })
    }

    fn umbrella() -> Result<(), Error> {
        list()?;
        Ok(())
    }

    fn boxed() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        list()?;
        Ok(())
    }

    #[test]
    fn post_send_list_error_converts_with_question_mark() {
        let e = umbrella().unwrap_err();
        assert!(matches!(
            e,
            Error::PostSendList(PostSendListError { index: 2, .. })
        ));
        assert_eq!(
            e.to_string(),
            "send request 2 of the list not posted (the 2 before it are): send queue full (4 requests outstanding)"
        );
        let b = boxed().unwrap_err();
        let src = b
            .source()
            .expect("the refused request's error is the source");
        assert_eq!(src.to_string(), "send queue full (4 requests outstanding)");
    }
}
