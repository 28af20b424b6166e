//! The work-request API of `struct ibv_qp_ex` (`ibv_wr_start`,
//! `ibv_wr_rdma_write`, `ibv_wr_set_sge`, ..., `ibv_wr_complete`): the
//! function pointers the inline `ibv_wr_*` helpers call.
//!
//! As in rdma-core, one QP's `wr_start` .. `wr_complete` sequence must not
//! run concurrently with another on the same QP (the application
//! serialises); the builder state lives in the QP object.

use std::ffi::{c_int, c_uint, c_void};

use softrdma_engine::{SendOp, SendWr, Sge};

use crate::abi::{Fp, ibv_mr, ibv_mw, ibv_qp_ex, ibv_sge};
use crate::ffi::guard;
use crate::verbs::{BindMw, Qp, post_send_errno, send_flags};

/// `send_ops_flags` this library implements: RDMA Write (+imm), Send
/// (+imm, +inv), RDMA Read, both atomics, local invalidate, bind of a type
/// 2 memory window.
pub const SUPPORTED_SEND_OPS: u64 = 0x3ff;

const MAX_SGE: usize = 16;

#[derive(Debug, Clone, Copy)]
enum Op {
    Send,
    SendImm(u32),
    SendInv(u32),
    Write(u64, u32),
    WriteImm(u64, u32, u32),
    Read(u64, u32),
    Cas(u64, u32, u64, u64),
    Faa(u64, u32, u64),
    LocalInv(u32),
    Bind(BindMw),
}

#[derive(Debug)]
struct Pending {
    wr_id: u64,
    flags: c_uint,
    op: Op,
    sge: [Sge; MAX_SGE],
    nsge: usize,
    inline: Option<Vec<u8>>,
}

/// The requests built between `wr_start` and `wr_complete`.
#[derive(Debug, Default)]
pub struct WrBuilder {
    pending: Vec<Pending>,
    error: c_int,
}

/// Fills the `wr_*` function pointers of a new QP.
pub fn fill(q: &mut ibv_qp_ex) {
    q.wr_atomic_cmp_swp = wr_atomic_cmp_swp as *const () as Fp;
    q.wr_atomic_fetch_add = wr_atomic_fetch_add as *const () as Fp;
    q.wr_bind_mw = wr_bind_mw as *const () as Fp;
    q.wr_local_inv = wr_local_inv as *const () as Fp;
    q.wr_rdma_read = wr_rdma_read as *const () as Fp;
    q.wr_rdma_write = wr_rdma_write as *const () as Fp;
    q.wr_rdma_write_imm = wr_rdma_write_imm as *const () as Fp;
    q.wr_send = wr_send as *const () as Fp;
    q.wr_send_imm = wr_send_imm as *const () as Fp;
    q.wr_send_inv = wr_send_inv as *const () as Fp;
    q.wr_send_tso = wr_unsupported4 as *const () as Fp;
    q.wr_set_ud_addr = wr_unsupported4 as *const () as Fp;
    q.wr_set_xrc_srqn = wr_unsupported4 as *const () as Fp;
    q.wr_set_inline_data = wr_set_inline_data as *const () as Fp;
    q.wr_set_inline_data_list = wr_set_inline_data_list as *const () as Fp;
    q.wr_set_sge = wr_set_sge as *const () as Fp;
    q.wr_set_sge_list = wr_set_sge_list as *const () as Fp;
    q.wr_start = wr_start as *const () as Fp;
    q.wr_complete = wr_complete as *const () as Fp;
    q.wr_abort = wr_abort as *const () as Fp;
    q.wr_atomic_write = wr_unsupported4 as *const () as Fp;
    q.wr_flush = wr_unsupported4 as *const () as Fp;
}

/// The QP and its builder.
///
/// # Safety
///
/// `qp` is a QP of this library, used by one thread for this sequence.
unsafe fn parts<'a>(qp: *mut ibv_qp_ex) -> (&'a Qp, &'a mut WrBuilder) {
    // SAFETY: our QPs start with ibv_qp_ex; the builder is only touched by
    // the thread running the sequence (the API's contract).
    unsafe {
        let q = &*qp.cast::<Qp>();
        (q, &mut *q.wr.get())
    }
}

fn push(qp: *mut ibv_qp_ex, op: Op) {
    guard((), || {
        if qp.is_null() {
            return;
        }
        // SAFETY: see `parts`.
        let (q, b) = unsafe { parts(qp) };
        b.pending.push(Pending {
            wr_id: q.qpx.wr_id,
            flags: q.qpx.wr_flags,
            op,
            sge: [Sge {
                addr: 0,
                length: 0,
                lkey: 0,
            }; MAX_SGE],
            nsge: 0,
            inline: None,
        });
    });
}

fn last(qp: *mut ibv_qp_ex, f: impl FnOnce(&mut Pending) -> Result<(), c_int>) {
    guard((), || {
        if qp.is_null() {
            return;
        }
        // SAFETY: see `parts`.
        let (_, b) = unsafe { parts(qp) };
        let r = match b.pending.last_mut() {
            Some(p) => f(p),
            None => Err(libc::EINVAL),
        };
        if let Err(e) = r
            && b.error == 0
        {
            b.error = e;
        }
    });
}

extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    guard((), || {
        if qp.is_null() {
            return;
        }
        // SAFETY: see `parts`.
        let (_, b) = unsafe { parts(qp) };
        b.pending.clear();
        b.error = 0;
    });
}

extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    wr_start(qp);
}

extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: see `parts`.
        let (q, b) = unsafe { parts(qp) };
        if b.error != 0 {
            let e = b.error;
            b.pending.clear();
            b.error = 0;
            return e;
        }
        let mut rc = 0;
        for p in b.pending.drain(..) {
            if rc != 0 {
                continue;
            }
            let op = match p.op {
                Op::Send => SendOp::Send,
                Op::SendImm(imm) => SendOp::SendWithImm {
                    imm: u32::from_be(imm),
                },
                Op::SendInv(k) => SendOp::SendWithInv { invalidate_rkey: k },
                Op::Write(a, k) => SendOp::Write {
                    remote_addr: a,
                    rkey: k,
                },
                Op::WriteImm(a, k, imm) => SendOp::WriteWithImm {
                    remote_addr: a,
                    rkey: k,
                    imm: u32::from_be(imm),
                },
                Op::Read(a, k) => SendOp::Read {
                    remote_addr: a,
                    rkey: k,
                },
                Op::Cas(a, k, c, s) => SendOp::CmpSwap {
                    remote_addr: a,
                    rkey: k,
                    compare: c,
                    swap: s,
                },
                Op::Faa(a, k, add) => SendOp::FetchAdd {
                    remote_addr: a,
                    rkey: k,
                    add,
                },
                Op::LocalInv(k) => SendOp::LocalInv { rkey: k },
                Op::Bind(bind) => {
                    if let Err(e) = bind.post(q, p.wr_id, p.flags) {
                        rc = e;
                    }
                    continue;
                }
            };
            let mut wr = SendWr::new(p.wr_id, op).flags(send_flags(p.flags));
            wr = match &p.inline {
                Some(data) => wr.inline(data),
                None => wr.sg_list(&p.sge[..p.nsge]),
            };
            if let Err(e) = q.inner.post_send(&wr) {
                rc = post_send_errno(e);
            }
        }
        rc
    })
}

extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    push(qp, Op::Send);
}
extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm: u32) {
    push(qp, Op::SendImm(imm));
}
extern "C" fn wr_send_inv(qp: *mut ibv_qp_ex, rkey: u32) {
    push(qp, Op::SendInv(rkey));
}
extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    push(qp, Op::Write(addr, rkey));
}
extern "C" fn wr_rdma_write_imm(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, imm: u32) {
    push(qp, Op::WriteImm(addr, rkey, imm));
}
extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    push(qp, Op::Read(addr, rkey));
}
extern "C" fn wr_atomic_cmp_swp(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, compare: u64, swap: u64) {
    push(qp, Op::Cas(addr, rkey, compare, swap));
}
extern "C" fn wr_atomic_fetch_add(qp: *mut ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    push(qp, Op::Faa(addr, rkey, add));
}
extern "C" fn wr_local_inv(qp: *mut ibv_qp_ex, rkey: u32) {
    push(qp, Op::LocalInv(rkey));
}

/// `struct ibv_mw_bind_info`.
#[repr(C)]
struct MwBindInfo {
    mr: *mut ibv_mr,
    addr: u64,
    length: u64,
    mw_access_flags: c_uint,
}

extern "C" fn wr_bind_mw(qp: *mut ibv_qp_ex, mw: *mut ibv_mw, rkey: u32, info: *const c_void) {
    let info = info.cast::<MwBindInfo>();
    if info.is_null() {
        // Pushed so that the sequence fails at `wr_complete`.
        push(
            qp,
            Op::Bind(BindMw {
                mw: std::ptr::null_mut(),
                rkey,
                mr: std::ptr::null_mut(),
                addr: 0,
                length: 0,
                access: 0,
            }),
        );
        return;
    }
    // SAFETY: the caller's bind info, read now (the API copies it).
    let i = unsafe { &*info };
    push(
        qp,
        Op::Bind(BindMw {
            mw,
            rkey,
            mr: i.mr,
            addr: i.addr,
            length: i.length,
            access: i.mw_access_flags,
        }),
    );
}

/// TSO, UD address, XRC, atomic write, flush: not supported; the
/// sequence's `wr_complete` fails with EOPNOTSUPP.
extern "C" fn wr_unsupported4(qp: *mut ibv_qp_ex, _a: usize, _b: usize, _c: usize) {
    guard((), || {
        if qp.is_null() {
            return;
        }
        // SAFETY: see `parts`.
        let (_, b) = unsafe { parts(qp) };
        if b.error == 0 {
            b.error = libc::EOPNOTSUPP;
        }
    });
}

extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    last(qp, |p| {
        p.sge[0] = Sge { addr, length, lkey };
        p.nsge = 1;
        p.inline = None;
        Ok(())
    });
}

extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    last(qp, |p| {
        if n > MAX_SGE || (n > 0 && list.is_null()) {
            return Err(libc::EINVAL);
        }
        for i in 0..n {
            // SAFETY: the caller's array holds n entries.
            let s = unsafe { *list.add(i) };
            p.sge[i] = Sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            };
        }
        p.nsge = n;
        p.inline = None;
        Ok(())
    });
}

extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *const c_void, length: usize) {
    last(qp, |p| {
        if addr.is_null() && length > 0 {
            return Err(libc::EINVAL);
        }
        let data = if length == 0 {
            Vec::new()
        } else {
            // SAFETY: inline data is copied at this call (API contract).
            unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), length) }.to_vec()
        };
        p.inline = Some(data);
        Ok(())
    });
}

/// `struct ibv_data_buf`.
#[repr(C)]
struct DataBuf {
    addr: *const c_void,
    length: usize,
}

extern "C" fn wr_set_inline_data_list(qp: *mut ibv_qp_ex, n: usize, list: *const c_void) {
    last(qp, |p| {
        if n > 0 && list.is_null() {
            return Err(libc::EINVAL);
        }
        let list = list.cast::<DataBuf>();
        let mut v = Vec::new();
        for i in 0..n {
            // SAFETY: the caller's array of n buffers, copied now.
            unsafe {
                let b = &*list.add(i);
                if !b.addr.is_null() {
                    v.extend_from_slice(std::slice::from_raw_parts(b.addr.cast::<u8>(), b.length));
                }
            }
        }
        p.inline = Some(v);
        Ok(())
    });
}
