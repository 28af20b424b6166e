//! Memory registration through the public API: protection domains, regions,
//! windows, fast-register regions, keys.

use std::collections::HashSet;

use softrdma_engine::mr::{RangeError, RegError};
use softrdma_engine::{Access, Device, ProtectionDomain};

fn pd() -> ProtectionDomain {
    ProtectionDomain::new(&Device::open_default().unwrap())
}

const RW: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

#[test]
fn protection_domains_have_distinct_ids_and_share_the_device() {
    let dev = Device::open_default().unwrap();
    let a = ProtectionDomain::new(&dev);
    let b = ProtectionDomain::new(&dev);
    assert_ne!(a.id(), b.id());
    let a2 = a.clone();
    assert_eq!(a2.id(), a.id());
    assert_eq!(a.device().name(), dev.name());
}

#[test]
fn register_owned_zeroed_page_aligned() {
    let pd = pd();
    let mr = pd.register(10_000, RW).unwrap();
    assert_eq!(mr.len(), 10_000);
    assert_eq!(mr.capacity(), 10_000);
    assert!(!mr.is_empty());
    assert_eq!(mr.access(), RW);
    assert_eq!(mr.pd_id(), pd.id());
    assert!(mr.is_valid());
    assert!(!mr.is_fast_reg());
    assert_eq!(mr.addr(), mr.as_ptr() as u64, "iova is the buffer address");
    assert_eq!(mr.addr() % 4096, 0);
    assert_eq!(mr.lkey(), mr.rkey());
    assert!(mr.lkey() >> 8 >= 1, "index 0 is never used");
    assert_eq!(mr.index(), mr.lkey() >> 8);
    assert!(mr.to_vec().iter().all(|&b| b == 0));
}

#[test]
fn read_write_fill_and_ranges() {
    let pd = pd();
    let mr = pd.register(64, Access::LOCAL_WRITE).unwrap();
    mr.write(10, b"abc").unwrap();
    let mut out = [0u8; 5];
    mr.read(9, &mut out).unwrap();
    assert_eq!(&out, b"\0abc\0");
    assert_eq!(
        mr.write(62, b"abc"),
        Err(RangeError {
            offset: 62,
            len: 3,
            region_len: 64
        })
    );
    assert!(mr.read(usize::MAX, &mut out).is_err());
    mr.write(61, b"xyz").unwrap();
    mr.fill(0x5a);
    assert_eq!(mr.to_vec(), vec![0x5a; 64]);
}

#[test]
fn register_vec_takes_the_buffer_without_copy() {
    let pd = pd();
    let v = b"registered bytes".to_vec();
    let p = v.as_ptr() as u64;
    let mr = pd.register_vec(v, Access::REMOTE_READ).unwrap();
    assert_eq!(mr.addr(), p);
    assert_eq!(mr.len(), 16);
    assert_eq!(mr.to_vec(), b"registered bytes");
}

#[test]
fn register_raw_uses_caller_memory() {
    let pd = pd();
    let mut buf = vec![1u8; 32];
    // SAFETY: `buf` outlives the region (dropped at the end of the test after
    // `mr`), and no reference to it is used while the region exists.
    let mr = unsafe { pd.register_raw(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE) }.unwrap();
    assert_eq!(mr.addr(), buf.as_ptr() as u64);
    mr.write(0, &[9, 9]).unwrap();
    drop(mr);
    assert_eq!(&buf[..3], &[9, 9, 1]);
}

#[test]
fn zero_length_regions() {
    let pd = pd();
    let mr = pd.register(0, RW).unwrap();
    assert!(mr.is_empty());
    assert_eq!(mr.to_vec(), Vec::<u8>::new());
    assert!(mr.write(0, &[]).is_ok());
    assert!(mr.write(0, &[1]).is_err());
    let sge = mr.sge(0, 0).unwrap();
    assert_eq!(sge.length, 0);
    let mr = pd.register_vec(Vec::new(), RW).unwrap();
    assert_eq!(mr.len(), 0);
}

#[test]
fn invalid_access_and_limits() {
    let pd = pd();
    for bad in [
        Access::REMOTE_WRITE,
        Access::REMOTE_ATOMIC,
        Access::REMOTE_WRITE | Access::REMOTE_READ,
    ] {
        assert_eq!(
            pd.register(8, bad).unwrap_err(),
            RegError::InvalidAccess(bad)
        );
        assert_eq!(
            pd.register_vec(vec![0; 8], bad).unwrap_err(),
            RegError::InvalidAccess(bad)
        );
    }
    let max = pd.device().attr().max_mr_size;
    assert!(matches!(
        pd.register(usize::MAX, Access::NONE),
        Err(RegError::TooLarge { .. })
    ));
    assert!(matches!(
        pd.alloc_mr(usize::MAX),
        Err(RegError::TooLarge { max: m, .. }) if m == max
    ));
}

#[test]
fn sge_helper() {
    let pd = pd();
    let mr = pd.register(100, Access::LOCAL_WRITE).unwrap();
    let sge = mr.sge(10, 90).unwrap();
    assert_eq!(
        (sge.addr, sge.length, sge.lkey),
        (mr.addr() + 10, 90, mr.lkey())
    );
    assert!(mr.sge(10, 91).is_err());
    assert!(mr.sge(usize::MAX, 1).is_err());
}

#[test]
fn rereg_changes_the_key_keeps_the_index_and_the_memory() {
    let pd = pd();
    let mut mr = pd.register(16, Access::LOCAL_WRITE).unwrap();
    mr.write(0, b"same").unwrap();
    let mut seen = vec![mr.lkey()];
    for _ in 0..50 {
        let prev = mr.lkey();
        let new = mr.rereg(Access::LOCAL_WRITE | Access::REMOTE_READ).unwrap();
        assert_ne!(new, prev);
        assert_eq!(new >> 8, prev >> 8);
        assert_eq!(mr.lkey(), new);
        seen.push(new);
    }
    assert_eq!(mr.access(), Access::LOCAL_WRITE | Access::REMOTE_READ);
    assert_eq!(&mr.to_vec()[..4], b"same");
    let distinct: HashSet<_> = seen.iter().collect();
    assert!(distinct.len() > 25, "keys repeat too much: {seen:x?}");
    assert_eq!(
        mr.rereg(Access::REMOTE_ATOMIC),
        Err(RegError::InvalidAccess(Access::REMOTE_ATOMIC))
    );
}

#[test]
fn keys_are_unpredictable() {
    let pd = pd();
    let regions: Vec<_> = (0..1000)
        .map(|_| pd.register(8, Access::REMOTE_READ).unwrap())
        .collect();
    let stags: Vec<u32> = regions.iter().map(|m| m.rkey()).collect();
    let unique: HashSet<_> = stags.iter().collect();
    assert_eq!(unique.len(), stags.len(), "live STags are unique");
    let keys: Vec<u8> = stags.iter().map(|s| (s & 0xff) as u8).collect();
    let distinct_keys: HashSet<_> = keys.iter().collect();
    // 1000 uniform draws from 256 values cover about 250 of them.
    assert!(
        distinct_keys.len() > 200,
        "{} distinct keys",
        distinct_keys.len()
    );
    let sequential = stags
        .windows(2)
        .filter(|w| w[1] == w[0].wrapping_add(1))
        .count();
    assert!(sequential < 20, "{sequential} sequential STags");
    let same_key = keys.windows(2).filter(|w| w[0] == w[1]).count();
    assert!(same_key < 30, "{same_key} repeated keys in a row");
}

#[test]
fn dropped_and_reregistered_memory_gets_new_stags() {
    let pd = pd();
    // 64 live at once (64 indices, one key each), then all dropped.
    let first: Vec<_> = (0..64)
        .map(|_| pd.register(8, Access::NONE).unwrap())
        .collect();
    let old: HashSet<u32> = first.iter().map(|m| m.rkey()).collect();
    drop(first);
    // All 64 were dropped; the next ones reuse their indices, each with a
    // key different from the index's previous one: no STag repeats.
    let again: Vec<_> = (0..64)
        .map(|_| pd.register(8, Access::NONE).unwrap())
        .collect();
    let repeats = again.iter().filter(|m| old.contains(&m.rkey())).count();
    assert_eq!(repeats, 0, "{repeats} STags repeated");
}

#[test]
fn deregister_without_windows() {
    let pd = pd();
    let mr = pd.register(8, RW).unwrap();
    assert_eq!(mr.bound_windows(), 0);
    mr.deregister().unwrap();
}

#[test]
fn fast_register_region_starts_invalid() {
    let pd = pd();
    let mr = pd.alloc_mr(8192).unwrap();
    assert!(mr.is_fast_reg());
    assert!(!mr.is_valid());
    assert_eq!(mr.capacity(), 8192);
    assert_eq!(mr.len(), 0);
    assert!(mr.sge(0, 1).is_err(), "no registered range yet");
    // The buffer is still usable locally.
    mr.write(0, b"x").unwrap();
    assert_eq!(mr.to_vec()[0], b'x');
}

#[test]
fn memory_windows_start_unbound() {
    let pd = pd();
    let a = pd.alloc_mw().unwrap();
    let b = pd.alloc_mw().unwrap();
    assert!(!a.is_bound());
    assert_ne!(a.rkey(), b.rkey());
    assert_eq!(a.pd_id(), pd.id());
    assert_eq!((a.addr(), a.len(), a.access()), (0, 0, Access::NONE));
    assert!(a.is_empty());
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ProtectionDomain>();
    check::<softrdma_engine::MemoryRegion>();
    check::<softrdma_engine::MemoryWindow>();
}

#[test]
fn concurrent_registration_from_threads() {
    let pd = pd();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let pd = pd.clone();
            std::thread::spawn(move || {
                (0..200)
                    .map(|_| pd.register(16, Access::REMOTE_READ).unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let all: Vec<_> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let stags: HashSet<_> = all.iter().map(|m| m.rkey()).collect();
    assert_eq!(stags.len(), all.len());
}
