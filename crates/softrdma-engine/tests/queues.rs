//! Completion queues, completion channels and shared receive queues through
//! the public API only (the completions themselves come from queue pairs; the
//! producer side is tested in the modules).

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use softrdma_engine::cq::{
    CompletionChannel, CompletionQueue, CreateCqError, GetEventError, NotifyError, ResizeError,
};
use softrdma_engine::mr::LocalAccessError;
use softrdma_engine::srq::{CreateSrqError, ModifySrqError, PostRecvError, SharedReceiveQueue};
use softrdma_engine::{Access, Device, ProtectionDomain, RecvWr, Sge};

#[test]
fn cq_lifecycle() {
    let dev = Device::open_default().unwrap();
    let cq = CompletionQueue::new(&dev, 16, None).unwrap();
    assert_eq!(cq.capacity(), 16);
    assert!(cq.is_empty());
    assert!(cq.poll_one().is_none());
    assert!(!cq.is_overflowed());
    assert_eq!(cq.req_notify(false), Err(NotifyError::NoChannel));
    cq.resize(1024).unwrap();
    assert_eq!(cq.capacity(), 1024);
    assert!(matches!(
        cq.resize(0),
        Err(ResizeError::InvalidSize { requested: 0, .. })
    ));
    assert!(matches!(
        CompletionQueue::new(&dev, 0, None),
        Err(CreateCqError::InvalidSize { .. })
    ));
    assert!(format!("{cq:?}").contains("CompletionQueue"));
}

#[test]
fn channel_fd_is_pollable_and_get_event_times_out() {
    let dev = Device::open_default().unwrap();
    let ch = CompletionChannel::new(&dev).unwrap();
    let cq = CompletionQueue::new(&dev, 16, Some(&ch)).unwrap();
    cq.req_notify(true).unwrap();
    cq.req_notify(false).unwrap();
    assert_eq!(ch.fd().as_raw_fd(), ch.as_raw_fd());

    // epoll (through `polling`): nothing pending, nothing ready.
    let poller = polling::Poller::new().unwrap();
    // SAFETY: the channel (and so its descriptor) outlives the registration,
    // which is deleted below.
    unsafe { poller.add(&ch.as_fd(), polling::Event::readable(1)) }.unwrap();
    let mut events = polling::Events::new();
    poller
        .wait(&mut events, Some(Duration::from_millis(5)))
        .unwrap();
    assert!(events.is_empty());
    poller.delete(ch.as_fd()).unwrap();

    assert!(ch.try_get_event().is_none());
    let start = Instant::now();
    assert!(matches!(
        ch.get_event(Some(Duration::from_millis(25))),
        Err(GetEventError::TimedOut)
    ));
    assert!(start.elapsed() >= Duration::from_millis(25));
    cq.ack_events(3);
    assert_eq!(cq.unacked_events(), 0);
}

#[test]
fn cq_refuses_a_channel_of_another_device() {
    let a = Device::open_default().unwrap();
    let b = Device::open_default().unwrap();
    let ch = CompletionChannel::new(&a).unwrap();
    assert!(matches!(
        CompletionQueue::new(&b, 4, Some(&ch)),
        Err(CreateCqError::ForeignChannel)
    ));
}

#[test]
fn srq_post_recv_checks_sges() {
    let dev = Device::open_default().unwrap();
    let pd = ProtectionDomain::new(&dev);
    let mr = pd.register(8192, Access::LOCAL_WRITE).unwrap();
    let srq = SharedReceiveQueue::new(&pd, 2, 4, 0).unwrap();
    assert_eq!(srq.max_wr(), 2);
    assert_eq!(srq.max_sge(), 4);
    let sg = [
        Sge {
            addr: mr.addr(),
            length: 4096,
            lkey: mr.lkey(),
        },
        Sge {
            addr: mr.addr() + 4096,
            length: 4096,
            lkey: mr.lkey(),
        },
    ];
    srq.post_recv(&RecvWr::new(1, &sg)).unwrap();
    let past_end = [Sge {
        addr: mr.addr() + 4096,
        length: 4097,
        lkey: mr.lkey(),
    }];
    assert!(matches!(
        srq.post_recv(&RecvWr::new(2, &past_end)),
        Err(PostRecvError::LocalAccess {
            index: 0,
            error: LocalAccessError::OutOfBounds { .. }
        })
    ));
    srq.post_recv(&RecvWr::new(2, &sg)).unwrap();
    assert_eq!(srq.len(), 2);
    assert_eq!(
        srq.post_recv(&RecvWr::new(3, &sg)),
        Err(PostRecvError::Full)
    );
    srq.modify_limit(1).unwrap();
    assert_eq!(srq.limit(), 1);
    assert_eq!(
        srq.modify_limit(3),
        Err(ModifySrqError::InvalidLimit {
            limit: 3,
            max_wr: 2
        })
    );
    assert!(matches!(
        SharedReceiveQueue::new(&pd, 2, 1, 3),
        Err(CreateSrqError::InvalidLimit { .. })
    ));
}
