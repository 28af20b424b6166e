//! Waits after the calling thread's locals were destroyed: glibc's `exit`
//! destroys the exiting thread's thread-locals before it runs the exit
//! handlers, and an exit handler may wait on a completion queue (sockets
//! direct's exit flush). A thread's own end destroys them the same way
//! (last made first), which these tests use.

use std::cell::RefCell;
use std::sync::Mutex;
use std::time::Duration;

use softrdma_engine::{CompletionQueue, Device, DeviceConfig, WcOpcode, WorkCompletion};

/// What the wait in [`WaitLate`]'s destructor did.
static OUTCOME: Mutex<Option<Result<usize, String>>> = Mutex::new(None);

/// Waits on its CQ when destroyed (with the thread's locals).
struct WaitLate(CompletionQueue);

impl Drop for WaitLate {
    fn drop(&mut self) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut out = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
            self.0
                .wait_progress(&mut out, Some(Duration::from_millis(5)))
        }))
        .map_err(|e| {
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default()
        });
        *OUTCOME.lock().unwrap() = Some(r);
    }
}

thread_local! {
    static LATE: RefCell<Option<WaitLate>> = const { RefCell::new(None) };
}

/// Regression: a CQ wait that sleeps used the thread's sleep set with
/// `with`, which panics ("cannot access a Thread Local Storage value
/// during or after destruction") once the thread's locals are destroyed;
/// a thread that had slept in a CQ wait before, then waited in an exit
/// handler, panicked there.
#[test]
fn a_cq_wait_after_the_threads_locals_were_destroyed_does_not_panic() {
    let mut cfg = DeviceConfig::default();
    cfg.poll_spin = Duration::from_micros(10);
    let dev = Device::open_with(cfg).unwrap();
    let cq = CompletionQueue::new(&dev, 4, None).unwrap();
    std::thread::spawn(move || {
        // Made first: destroyed after the sleep set the wait below makes.
        LATE.with(|l| *l.borrow_mut() = Some(WaitLate(cq.clone())));
        let mut out = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        assert_eq!(
            cq.wait_progress(&mut out, Some(Duration::from_millis(2))),
            0
        );
    })
    .join()
    .unwrap();
    let outcome = OUTCOME.lock().unwrap().take();
    assert_eq!(outcome, Some(Ok(0)));
}
