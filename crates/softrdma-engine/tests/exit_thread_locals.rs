//! Calls after the calling thread's locals were destroyed: glibc's `exit`
//! destroys the exiting thread's thread-locals before it runs the exit
//! handlers, and an exit handler may wait on a completion queue (sockets
//! direct's exit flush) or register memory. A thread's own end destroys
//! them the same way (last made first), which the CQ wait test uses; the
//! registration test runs a child process (this test binary again) that
//! calls `exit`.

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

/// Set in the child process a test runs: the name of the child test to
/// run (the child tests do nothing otherwise).
const CHILD_ENV: &str = "SOFTRDMA_EXIT_TLS_CHILD";

/// What the child's exit handler writes to standard error when it ran to
/// its end.
const DONE: &str = "exit handler done";

/// Runs the child test `name` (this test binary again) and expects it to
/// exit with success, its exit handler done and no panic.
fn run_child(name: &str) {
    let out = std::process::Command::new("timeout")
        .arg("120")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--include-ignored", "--nocapture", "-q"])
        .env(CHILD_ENV, name)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains(DONE) && !err.contains("panicked"),
        "child {name}: {:?}\n{err}",
        out.status
    );
}

/// Whether this process is the child running `name`.
fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|n| n == name)
}

/// Registers `f` as an exit handler and calls `exit` (glibc destroys the
/// calling thread's thread-locals, then runs `f`).
fn exit_with(f: extern "C" fn()) -> ! {
    // (A panic in `f`, an `extern "C"` function, aborts the child.)
    assert!(softrdma_engine::at_exit(f));
    // `exit(3)`, as the C library's: thread-locals, then exit handlers.
    std::process::exit(0)
}

/// The protection domain the child's exit handler registers memory in.
static PD: Mutex<Option<softrdma_engine::ProtectionDomain>> = Mutex::new(None);

extern "C" fn register_late() {
    let pd = PD.lock().unwrap().take().unwrap();
    let mr = pd
        .register(4096, softrdma_engine::Access::LOCAL_WRITE)
        .unwrap();
    assert_ne!(mr.lkey(), 0);
    eprintln!("{DONE}");
}

/// Regression: registering memory drew the STag index and key from
/// `rand::rng()`, a thread-local with a destructor, which panics once
/// glibc's `exit` destroyed the thread's locals; an exit handler that
/// registered memory (or connected) on a thread that had registered
/// before aborted the process.
#[test]
fn registering_memory_in_an_exit_handler_after_the_thread_registered_does_not_panic() {
    run_child("registering_memory_in_an_exit_handler_child");
}

#[test]
#[ignore = "the child process of the test above"]
fn registering_memory_in_an_exit_handler_child() {
    if !is_child("registering_memory_in_an_exit_handler_child") {
        return;
    }
    let dev = Device::open_default().unwrap();
    let pd = softrdma_engine::ProtectionDomain::new(&dev);
    // The thread's random generator is made (and destroyed by `exit`).
    let first = pd
        .register(4096, softrdma_engine::Access::LOCAL_WRITE)
        .unwrap();
    drop(first);
    *PD.lock().unwrap() = Some(pd);
    exit_with(register_late)
}
