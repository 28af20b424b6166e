//! The `#[repr(C)]` mirrors match the installed rdma-core headers: a C
//! program prints sizes and offsets, compared with the Rust structs.

mod common;

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

use softrdma_verbs::abi::*;

fn rust_layout() -> HashMap<&'static str, usize> {
    let mut m = HashMap::new();
    macro_rules! s {
        ($t:ident) => {
            m.insert(stringify!($t), size_of::<$t>());
        };
    }
    macro_rules! o {
        ($t:ident, $f:ident) => {
            m.insert(
                concat!(stringify!($t), ".", stringify!($f)),
                offset_of!($t, $f),
            );
        };
        ($name:literal, $t:ident, $f:ident) => {
            m.insert($name, offset_of!($t, $f));
        };
    }
    s!(ibv_device);
    o!(ibv_device, node_type);
    o!(ibv_device, transport_type);
    o!(ibv_device, name);
    o!(ibv_device, dev_name);
    o!(ibv_device, dev_path);
    o!(ibv_device, ibdev_path);
    s!(ibv_context);
    o!(ibv_context, ops);
    o!(ibv_context, cmd_fd);
    o!(ibv_context, async_fd);
    o!(ibv_context, num_comp_vectors);
    o!(ibv_context, mutex);
    o!(ibv_context, abi_compat);
    m.insert("ops.poll_cq", ops::POLL_CQ * 8);
    m.insert("ops.req_notify_cq", ops::REQ_NOTIFY_CQ * 8);
    m.insert("ops.post_srq_recv", ops::POST_SRQ_RECV * 8);
    m.insert("ops.post_send", ops::POST_SEND * 8);
    m.insert("ops.post_recv", ops::POST_RECV * 8);
    m.insert("ops.alloc_mw", ops::ALLOC_MW * 8);
    m.insert("ops.bind_mw", ops::BIND_MW * 8);
    m.insert("ops.dealloc_mw", ops::DEALLOC_MW * 8);
    s!(verbs_context);
    m.insert("verbs_context.query_port", vctx::QUERY_PORT * 8);
    m.insert("verbs_context.create_cq_ex", vctx::CREATE_CQ_EX * 8);
    m.insert("verbs_context.query_device_ex", vctx::QUERY_DEVICE_EX * 8);
    m.insert("verbs_context.create_qp_ex", vctx::CREATE_QP_EX * 8);
    m.insert("verbs_context.sz", vctx::SZ * 8);
    o!(verbs_context, context);
    s!(ibv_pd);
    s!(ibv_mr);
    o!(ibv_mr, addr);
    o!(ibv_mr, length);
    o!(ibv_mr, lkey);
    o!(ibv_mr, rkey);
    s!(ibv_mw);
    o!(ibv_mw, pd);
    o!(ibv_mw, rkey);
    o!(ibv_mw, handle);
    o!("ibv_mw.type", ibv_mw, type_);
    s!(ibv_comp_channel);
    o!(ibv_comp_channel, fd);
    o!(ibv_comp_channel, refcnt);
    s!(ibv_cq);
    o!(ibv_cq, channel);
    o!(ibv_cq, cq_context);
    o!(ibv_cq, cqe);
    o!(ibv_cq, mutex);
    o!(ibv_cq, cond);
    o!(ibv_cq, comp_events_completed);
    o!(ibv_cq, async_events_completed);
    s!(ibv_srq);
    o!(ibv_srq, pd);
    o!(ibv_srq, handle);
    o!(ibv_srq, events_completed);
    s!(ibv_qp);
    o!(ibv_qp, qp_num);
    o!(ibv_qp, state);
    o!(ibv_qp, qp_type);
    o!(ibv_qp, mutex);
    o!(ibv_qp, cond);
    o!(ibv_qp, events_completed);
    // v44's ibv_qp_ex ends where newer headers add wr_flush (allocated too).
    m.insert("ibv_qp_ex", offset_of!(ibv_qp_ex, wr_flush));
    o!(ibv_qp_ex, comp_mask);
    o!(ibv_qp_ex, wr_id);
    o!(ibv_qp_ex, wr_flags);
    o!(ibv_qp_ex, wr_atomic_cmp_swp);
    o!(ibv_qp_ex, wr_rdma_write);
    o!(ibv_qp_ex, wr_send);
    o!(ibv_qp_ex, wr_set_inline_data);
    o!(ibv_qp_ex, wr_set_sge);
    o!(ibv_qp_ex, wr_set_sge_list);
    o!(ibv_qp_ex, wr_start);
    o!(ibv_qp_ex, wr_complete);
    o!(ibv_qp_ex, wr_abort);
    o!(ibv_qp_ex, wr_atomic_write);
    s!(ibv_sge);
    s!(ibv_recv_wr);
    s!(ibv_send_wr);
    o!(ibv_send_wr, opcode);
    o!(ibv_send_wr, send_flags);
    o!(ibv_send_wr, imm_data);
    o!("ibv_send_wr.wr.rdma.remote_addr", ibv_send_wr, remote_addr);
    o!("ibv_send_wr.wr.rdma.rkey", ibv_send_wr, compare_add);
    o!(
        "ibv_send_wr.wr.atomic.compare_add",
        ibv_send_wr,
        compare_add
    );
    o!("ibv_send_wr.wr.atomic.swap", ibv_send_wr, swap);
    o!("ibv_send_wr.wr.atomic.rkey", ibv_send_wr, atomic_rkey);
    o!(ibv_send_wr, qp_type);
    o!(ibv_send_wr, bind_mw);
    s!(ibv_wc);
    o!(ibv_wc, status);
    o!(ibv_wc, opcode);
    o!(ibv_wc, byte_len);
    o!(ibv_wc, imm_data);
    o!(ibv_wc, qp_num);
    o!(ibv_wc, wc_flags);
    o!(ibv_wc, sl);
    s!(ibv_qp_init_attr);
    o!(ibv_qp_init_attr, cap);
    o!(ibv_qp_init_attr, qp_type);
    o!(ibv_qp_init_attr, sq_sig_all);
    s!(ibv_qp_init_attr_ex);
    o!(ibv_qp_init_attr_ex, comp_mask);
    o!(ibv_qp_init_attr_ex, pd);
    o!(ibv_qp_init_attr_ex, create_flags);
    o!(ibv_qp_init_attr_ex, send_ops_flags);
    s!(ibv_qp_attr);
    o!(ibv_qp_attr, cap);
    o!(ibv_qp_attr, ah_attr);
    o!(ibv_qp_attr, alt_ah_attr);
    o!(ibv_qp_attr, max_rd_atomic);
    o!(ibv_qp_attr, max_dest_rd_atomic);
    o!(ibv_qp_attr, rate_limit);
    s!(ibv_device_attr);
    o!(ibv_device_attr, node_guid);
    o!(ibv_device_attr, max_qp);
    o!(ibv_device_attr, atomic_cap);
    o!(ibv_device_attr, max_srq_sge);
    o!(ibv_device_attr, max_pkeys);
    o!(ibv_device_attr, phys_port_cnt);
    s!(ibv_port_attr);
    o!(ibv_port_attr, gid_tbl_len);
    o!(ibv_port_attr, lid);
    o!(ibv_port_attr, link_layer);
    o!(ibv_port_attr, flags);
    o!(ibv_port_attr, port_cap_flags2);
    s!(ibv_gid_entry);
    s!(ibv_async_event);
    s!(ibv_srq_init_attr);
    s!(rdma_cm_id);
    o!(rdma_cm_id, qp);
    o!(rdma_cm_id, route);
    o!(rdma_cm_id, ps);
    o!(rdma_cm_id, port_num);
    o!(rdma_cm_id, event);
    o!(rdma_cm_id, send_cq);
    o!(rdma_cm_id, recv_cq);
    o!(rdma_cm_id, srq);
    o!(rdma_cm_id, pd);
    o!(rdma_cm_id, qp_type);
    s!(rdma_route);
    o!(rdma_route, path_rec);
    o!(rdma_route, num_paths);
    s!(rdma_cm_event);
    o!(rdma_cm_event, event);
    o!(rdma_cm_event, status);
    o!("rdma_cm_event.param", rdma_cm_event, conn);
    s!(rdma_conn_param);
    o!(rdma_conn_param, private_data_len);
    o!(rdma_conn_param, responder_resources);
    o!(rdma_conn_param, initiator_depth);
    o!(rdma_conn_param, qp_num);
    s!(rdma_addrinfo);
    o!(rdma_addrinfo, ai_src_addr);
    o!(rdma_addrinfo, ai_dst_addr);
    o!(rdma_addrinfo, ai_next);
    m
}

#[test]
fn rust_structs_match_the_installed_headers() {
    if !common::have_headers() {
        eprintln!(
            "SKIP: <infiniband/verbs.h>/<rdma/rdma_cma.h> or cc missing (apt-get install libibverbs-dev librdmacm-dev)"
        );
        return;
    }
    let exe = common::compile("layout", &[]);
    let out = Command::new(&exe).output().expect("run layout probe");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let rust = rust_layout();
    let mut checked = 0;
    let mut bad = Vec::new();
    for line in text.lines() {
        let (name, value) = line.rsplit_once(' ').expect("name value");
        let c: usize = value.parse().expect("number");
        match rust.get(name) {
            Some(&r) if r == c => checked += 1,
            Some(&r) => bad.push(format!("{name}: C {c}, Rust {r}")),
            None => bad.push(format!("{name}: not mirrored")),
        }
    }
    let _ = std::fs::remove_file(&exe);
    assert!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
    assert_eq!(
        checked,
        rust.len(),
        "every Rust entry is checked by the probe"
    );
}
