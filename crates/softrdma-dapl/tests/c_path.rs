//! The provider's entry points called as libdat2 calls them (through the
//! table): handle validation, states, parameters, not-implemented slots.

use std::ffi::{c_char, c_void};
use std::net::{IpAddr, Ipv4Addr};

use softrdma_dapl::table::{NAMES, NOT_IMPLEMENTED};
use softrdma_dapl::types::*;

type H = *mut c_void;

fn slot(t: &DAT_PROVIDER, name: &str) -> *const c_void {
    let i = NAMES.iter().position(|n| *n == name).unwrap();
    t.funcs[i]
}

macro_rules! call {
    ($t:expr, $name:literal, fn($($ty:ty),*) $(, $a:expr)*) => {{
        let f = slot($t, $name);
        // SAFETY: the slot holds the entry point of this C signature.
        let f: unsafe extern "C" fn($($ty),*) -> u32 = unsafe { std::mem::transmute(f) };
        // SAFETY: the arguments follow the DAT signature.
        unsafe { f($($a),*) }
    }};
}

const INVALID_HANDLE: u32 = 0x5_0000;
const INVALID_PARAMETER: u32 = 0x6_0000;
const INVALID_STATE: u32 = 0x7_0000;
const NOT_IMPLEMENTED_RET: u32 = 0x3fff_0000;

fn ty(r: u32) -> u32 {
    r & 0x3fff_0000
}

#[test]
fn handles_states_parameters_through_the_table() {
    let t = softrdma_dapl::register_for_tests("c-path", IpAddr::V4(Ipv4Addr::LOCALHOST));
    let mut ia: H = std::ptr::null_mut();
    let mut async_evd: H = std::ptr::null_mut();
    let name = c"c-path";
    assert_eq!(
        call!(
            t,
            "ia_open",
            fn(*const c_char, i32, *mut H, *mut H),
            name.as_ptr(),
            8,
            &mut async_evd,
            &mut ia
        ),
        0
    );
    assert!(!ia.is_null() && !async_evd.is_null());
    // The first word of every handle is the provider table.
    // SAFETY: a live handle points to memory starting with the table pointer.
    let first = unsafe { *(ia as *const *const DAT_PROVIDER) };
    assert_eq!(first, t as *const _);
    let unknown = call!(
        t,
        "ia_open",
        fn(*const c_char, i32, *mut H, *mut H),
        c"nope".as_ptr(),
        8,
        &mut async_evd,
        &mut ia
    );
    assert_eq!(
        unknown, 0xa_0064,
        "DAT_PROVIDER_NOT_FOUND / NAME_NOT_REGISTERED"
    );

    let mut pz: H = std::ptr::null_mut();
    assert_eq!(call!(t, "pz_create", fn(H, *mut H), ia, &mut pz), 0);
    let mut kind = 99u32;
    assert_eq!(
        call!(t, "get_handle_type", fn(H, *mut u32), pz, &mut kind),
        0
    );
    assert_eq!(kind, 6, "DAT_HANDLE_TYPE_PZ");

    // A PZ handle where an EVD is expected, and a pointer that is no handle.
    let mut ev = std::mem::MaybeUninit::<DAT_EVENT>::zeroed();
    assert_eq!(
        ty(call!(
            t,
            "evd_dequeue",
            fn(H, *mut DAT_EVENT),
            pz,
            ev.as_mut_ptr()
        )),
        INVALID_HANDLE
    );
    let mut junk = [0u64; 4];
    let junk_h = junk.as_mut_ptr().cast::<c_void>();
    assert_eq!(ty(call!(t, "pz_free", fn(H), junk_h)), INVALID_HANDLE);
    assert_eq!(
        ty(call!(t, "pz_free", fn(H), std::ptr::null_mut())),
        INVALID_HANDLE
    );

    // EP on the PZ: the PZ is in use; posting needs a connection; private
    // data over the maximum is refused; the IA cannot close gracefully.
    let mut evd: H = std::ptr::null_mut();
    assert_eq!(
        call!(
            t,
            "evd_create",
            fn(H, i32, H, u32, *mut H),
            ia,
            16,
            std::ptr::null_mut(),
            0x20 | 0x40,
            &mut evd
        ),
        0
    );
    let mut ep: H = std::ptr::null_mut();
    assert_eq!(
        call!(
            t,
            "ep_create",
            fn(H, H, H, H, H, *const DAT_EP_ATTR, *mut H),
            ia,
            pz,
            evd,
            evd,
            evd,
            std::ptr::null(),
            &mut ep
        ),
        0
    );
    assert_eq!(
        call!(t, "pz_free", fn(H), pz),
        0x7_0053,
        "INVALID_STATE PZ_IN_USE"
    );
    let mut seg = DAT_LMR_TRIPLET {
        virtual_address: 0,
        segment_length: 0,
        lmr_context: 0,
    };
    assert_eq!(
        ty(call!(
            t,
            "ep_post_send",
            fn(H, i32, *mut DAT_LMR_TRIPLET, u64, u32),
            ep,
            1,
            &mut seg,
            1,
            0
        )),
        INVALID_STATE
    );
    // SAFETY: sockaddr_in is plain data; all-zero is valid.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as u16;
    sa.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
    let big = [0u8; 300];
    assert_eq!(
        ty(call!(
            t,
            "ep_connect",
            fn(H, *mut libc::sockaddr, u64, u32, i32, *const c_void, u32, u32),
            ep,
            (&mut sa as *mut libc::sockaddr_in).cast(),
            45000,
            1000,
            300,
            big.as_ptr().cast(),
            0,
            0
        )),
        INVALID_PARAMETER
    );
    let mut st = 99u32;
    assert_eq!(
        call!(
            t,
            "ep_get_status",
            fn(H, *mut u32, *mut u32, *mut u32),
            ep,
            &mut st,
            std::ptr::null_mut(),
            std::ptr::null_mut()
        ),
        0
    );
    assert_eq!(st, 0, "UNCONNECTED");

    let (mut nbufs, mut span) = (7, 7);
    assert_eq!(
        call!(
            t,
            "ep_recv_query",
            fn(H, *mut i32, *mut i32),
            ep,
            &mut nbufs,
            &mut span
        ),
        0
    );
    assert_eq!((nbufs, span), (0, -2), "no receive posted; span unknown");

    // dat_ep_modify: IRD/ORD and limits of an unconnected EP.
    // SAFETY: DAT_EP_PARAM is plain data; all-zero is valid.
    let mut prm: DAT_EP_PARAM = unsafe { std::mem::zeroed() };
    prm.ep_attr.max_rdma_read_out = 1;
    prm.ep_attr.max_rdma_read_iov = 1;
    let modify = |mask: u64, p: *const DAT_EP_PARAM| {
        call!(t, "ep_modify", fn(H, u64, *const DAT_EP_PARAM), ep, mask, p)
    };
    assert_eq!(modify(0x0080_0000 | 0x0200_0000, &prm), 0);
    // SAFETY: as above.
    let mut q: DAT_EP_PARAM = unsafe { std::mem::zeroed() };
    assert_eq!(
        call!(
            t,
            "ep_query",
            fn(H, u64, *mut DAT_EP_PARAM),
            ep,
            u64::MAX,
            &mut q
        ),
        0
    );
    assert_eq!(
        (q.ep_attr.max_rdma_read_out, q.ep_attr.max_rdma_read_iov),
        (1, 1)
    );
    assert_eq!(ty(modify(0x1, &prm)), INVALID_PARAMETER, "the IA is fixed");
    assert_eq!(modify(0x100, &prm), NOT_IMPLEMENTED_RET, "EVDs stay");
    assert_eq!(ty(modify(0x0080_0000, std::ptr::null())), INVALID_PARAMETER);
    prm.ep_attr.max_rdma_read_out = 0;
    assert_eq!(ty(modify(0x0080_0000, &prm)), INVALID_PARAMETER);
    prm.ep_attr.max_rdma_read_out = -1;
    assert_eq!(ty(modify(0x0080_0000, &prm)), INVALID_PARAMETER);
    assert_eq!(
        call!(t, "ia_close", fn(H, u32), ia, 1),
        0x7_0050,
        "INVALID_STATE IA_IN_USE"
    );

    // Freed handles are invalid, never dereferenced.
    assert_eq!(call!(t, "ep_free", fn(H), ep), 0);
    assert_eq!(ty(call!(t, "ep_free", fn(H), ep)), INVALID_HANDLE);
    assert_eq!(call!(t, "evd_free", fn(H), evd), 0);
    assert_eq!(call!(t, "pz_free", fn(H), pz), 0);
    assert_eq!(
        call!(t, "pz_free", fn(H), pz),
        0x5_000f,
        "INVALID_HANDLE PZ"
    );
    assert_eq!(
        ty(call!(
            t,
            "evd_wait",
            fn(H, u32, i32, *mut DAT_EVENT, *mut i32),
            evd,
            0,
            1,
            ev.as_mut_ptr(),
            std::ptr::null_mut()
        )),
        INVALID_HANDLE
    );

    // Every slot listed as not implemented says so.
    for n in NOT_IMPLEMENTED {
        let f = slot(t, n);
        // SAFETY: the not-implemented entry takes no argument it reads.
        let f: unsafe extern "C" fn() -> u32 = unsafe { std::mem::transmute(f) };
        // SAFETY: as above.
        let r = unsafe { f() };
        assert_eq!(r, NOT_IMPLEMENTED_RET, "{n}");
    }
    assert_eq!(call!(t, "ia_close", fn(H, u32), ia, 1), 0);
    assert_eq!(ty(call!(t, "ia_close", fn(H, u32), ia, 0)), INVALID_HANDLE);
}
