//! A uDAPL (DAT 2.0) provider over softrdma.
//!
//! Stock `libdat2.so.2` loads `libsoftrdma_dapl.so` from a `dat.conf` line
//! such as
//!
//! ```text
//! softrdma-lo u2.0 nonthreadsafe default /abs/path/libsoftrdma_dapl.so dapl.2.0 "127.0.0.1 0" ""
//! ```
//!
//! (selected with `DAT_OVERRIDE=/path/dat.conf`), calls
//! [`dat_provider_init`] with the line's IA name and parameters (`"<IPv4
//! or IPv6 address> <ignored>"`), and the provider registers a table of
//! the 79 DAT entry points for that name. Every entry point translates to
//! [`softrdma_dat`]: it catches panics (`DAT_INTERNAL_ERROR`), validates
//! every handle (a freed or wrong-type handle is `DAT_INVALID_HANDLE`, never
//! a crash) and returns the `DAT_RETURN` of the Rust error. Nothing runs at
//! load time; the threads of an IA end when it is closed; the library is
//! linked `-z nodelete` so a `dlclose` after the last IA never unmaps code
//! an engine thread may still be leaving.
//!
//! The slots that answer `DAT_NOT_IMPLEMENTED` are
//! [`table::NOT_IMPLEMENTED`].

pub mod handles;
pub mod table;
pub mod types;

mod api;

use std::ffi::{CStr, CString, c_char, c_void};
use std::net::IpAddr;

use parking_lot::Mutex;

use crate::types::{DAT_PROVIDER, DAT_PROVIDER_INFO};

/// One registered IA name: its table and parameters.
#[derive(Debug)]
pub struct Provider {
    /// The table libdat2 calls through.
    pub table: DAT_PROVIDER,
    /// The IA name (`device_name` points here).
    pub name: CString,
    /// The IA address from the `dat.conf` parameters.
    pub addr: IpAddr,
}

// SAFETY: the table's pointers are to static functions and to `name`,
// which is never changed after registration.
unsafe impl Send for Provider {}
// SAFETY: as above.
unsafe impl Sync for Provider {}

static PROVIDERS: Mutex<Vec<&'static Provider>> = Mutex::new(Vec::new());

/// The provider registered for IA `name`.
pub fn provider_by_name(name: &str) -> Option<&'static Provider> {
    PROVIDERS
        .lock()
        .iter()
        .copied()
        .find(|p| p.name.to_str() == Ok(name))
}

/// Parses `ia_params` (`"<address> <port, ignored>"`); the first word is
/// an IPv4 or IPv6 address, `localhost`, or empty (127.0.0.1).
pub fn parse_ia_params(params: &str) -> Option<IpAddr> {
    let first = params.split_whitespace().next().unwrap_or("127.0.0.1");
    if first == "localhost" {
        return Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    }
    first.parse().ok().filter(|a: &IpAddr| !a.is_unspecified())
}

type RegistryFn = unsafe extern "C" fn(*const DAT_PROVIDER, *const DAT_PROVIDER_INFO) -> u32;

/// A libdat2 function, found in the process at run time (the provider is
/// not linked against libdat2, so it loads anywhere).
fn libdat2_fn(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name has no
    // other precondition.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// `dat_provider_init`: registers the table for `info.ia_name`.
///
/// # Safety
///
/// `info` must point to a valid `DAT_PROVIDER_INFO` and `ia_params` to a
/// NUL-terminated string or be NULL (libdat2 guarantees both).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dat_provider_init(
    info: *const DAT_PROVIDER_INFO,
    ia_params: *const c_char,
) {
    let _ = std::panic::catch_unwind(|| {
        if info.is_null() {
            return;
        }
        // SAFETY: the caller passes a valid info whose name is
        // NUL-terminated within its 256 bytes.
        let name = unsafe { CStr::from_ptr((*info).ia_name.as_ptr()) }.to_owned();
        let params = if ia_params.is_null() {
            String::new()
        } else {
            // SAFETY: the caller passes a NUL-terminated string.
            unsafe { CStr::from_ptr(ia_params) }
                .to_string_lossy()
                .into_owned()
        };
        let Some(addr) = parse_ia_params(&params) else {
            return;
        };
        let p = match provider_by_name(&name.to_string_lossy()) {
            Some(p) => p,
            None => add_provider(name.clone(), addr),
        };
        if let Some(f) = libdat2_fn(c"dat_registry_add_provider") {
            // SAFETY: the symbol is libdat2's dat_registry_add_provider,
            // whose signature is RegistryFn; both pointers are valid.
            let f: RegistryFn = unsafe { std::mem::transmute::<*mut c_void, RegistryFn>(f) };
            // SAFETY: as above.
            unsafe { f(&p.table, info) };
        }
    });
}

/// `dat_provider_fini`: removes the table for `info.ia_name`.
///
/// # Safety
///
/// As [`dat_provider_init`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dat_provider_fini(info: *const DAT_PROVIDER_INFO) {
    let _ = std::panic::catch_unwind(|| {
        if info.is_null() {
            return;
        }
        // SAFETY: as in dat_provider_init.
        let name = unsafe { CStr::from_ptr((*info).ia_name.as_ptr()) };
        let Some(p) = provider_by_name(&name.to_string_lossy()) else {
            return;
        };
        if let Some(f) = libdat2_fn(c"dat_registry_remove_provider") {
            // SAFETY: libdat2's dat_registry_remove_provider has the
            // RegistryFn signature; both pointers are valid.
            let f: RegistryFn = unsafe { std::mem::transmute::<*mut c_void, RegistryFn>(f) };
            // SAFETY: as above.
            unsafe { f(&p.table, info) };
        }
    });
}

/// Registers a table for `name` at `addr` without libdat2 (tests and
/// programs that call the table directly). Returns the table.
pub fn register_for_tests(name: &str, addr: IpAddr) -> &'static DAT_PROVIDER {
    if let Some(p) = provider_by_name(name) {
        return &p.table;
    }
    &add_provider(CString::new(name).unwrap_or_default(), addr).table
}

/// A new table for the IA `name` at `addr`, kept for the life of the
/// process and listed in `PROVIDERS`.
fn add_provider(name: CString, addr: IpAddr) -> &'static Provider {
    let mut table = DAT_PROVIDER {
        device_name: std::ptr::null(),
        extension: std::ptr::null_mut(),
        funcs: api::table(),
    };
    // The CString's bytes stay where they are when it moves into the box.
    table.device_name = name.as_ptr();
    let p: &'static Provider = Box::leak(Box::new(Provider { table, name, addr }));
    PROVIDERS.lock().push(p);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ia_params_name_the_address() {
        assert_eq!(
            parse_ia_params("127.0.0.1 0"),
            Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            parse_ia_params("10.1.2.3 0"),
            Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 2, 3)))
        );
        assert_eq!(
            parse_ia_params("::1 0"),
            Some(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST))
        );
        assert_eq!(
            parse_ia_params("localhost 0"),
            Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
        );
        assert_eq!(
            parse_ia_params(""),
            Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
        );
        assert_eq!(parse_ia_params("0.0.0.0 0"), None, "no valid IA address");
        assert_eq!(
            parse_ia_params("eth0 0"),
            None,
            "interface names are not resolved"
        );
    }
}
