//! Layout test: every struct shared with C against `/usr/include/dat2`.
//! A C probe compiled with the system `cc` prints `sizeof`/`offsetof`;
//! the test compares them with the Rust definitions. Skipped (with a
//! message) when the headers or `cc` are absent.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::mem::{offset_of, size_of};
use std::process::Command;

use softrdma_dapl::table::NAMES;
use softrdma_dapl::types::*;

struct Probe {
    c: String,
    rust: Vec<(String, usize)>,
}

impl Probe {
    fn size(&mut self, name: &str, v: usize) {
        let _ = writeln!(self.c, "printf(\"{name} %zu\\n\", sizeof({name}));");
        self.rust.push((name.to_string(), v));
    }
    fn off(&mut self, ty: &str, field: &str, v: usize) {
        let _ = writeln!(
            self.c,
            "printf(\"{ty}.{field} %zu\\n\", offsetof({ty}, {field}));"
        );
        self.rust.push((format!("{ty}.{field}"), v));
    }
}

macro_rules! layout {
    ($p:expr, $t:ident { $($f:ident),* $(,)? }) => {{
        $p.size(stringify!($t), size_of::<$t>());
        $( $p.off(stringify!($t), stringify!($f), offset_of!($t, $f)); )*
    }};
}

#[test]
fn structs_match_the_installed_headers() {
    if !std::path::Path::new("/usr/include/dat2/udat.h").exists() {
        eprintln!("SKIPPED: /usr/include/dat2 is not installed (apt-get install libdapl-dev)");
        return;
    }
    let mut p = Probe {
        c: String::new(),
        rust: Vec::new(),
    };
    layout!(p, DAT_NAMED_ATTR { name, value });
    layout!(
        p,
        DAT_PROVIDER_INFO {
            ia_name,
            dapl_version_major,
            dapl_version_minor,
            is_thread_safe
        }
    );
    layout!(
        p,
        DAT_LMR_TRIPLET {
            virtual_address,
            segment_length,
            lmr_context
        }
    );
    layout!(
        p,
        DAT_RMR_TRIPLET {
            virtual_address,
            segment_length,
            rmr_context
        }
    );
    layout!(
        p,
        DAT_EP_ATTR {
            service_type,
            max_message_size,
            max_rdma_size,
            qos,
            recv_completion_flags,
            request_completion_flags,
            max_recv_dtos,
            max_request_dtos,
            max_recv_iov,
            max_request_iov,
            max_rdma_read_in,
            max_rdma_read_out,
            srq_soft_hw,
            max_rdma_read_iov,
            max_rdma_write_iov,
            ep_transport_specific_count,
            ep_transport_specific,
            ep_provider_specific_count,
            ep_provider_specific,
        }
    );
    layout!(
        p,
        DAT_EP_PARAM {
            ia_handle,
            ep_state,
            comm,
            local_ia_address_ptr,
            local_port_qual,
            remote_ia_address_ptr,
            remote_port_qual,
            pz_handle,
            recv_evd_handle,
            request_evd_handle,
            connect_evd_handle,
            srq_handle,
            ep_attr,
        }
    );
    layout!(
        p,
        DAT_SRQ_ATTR {
            max_recv_dtos,
            max_recv_iov,
            low_watermark
        }
    );
    layout!(
        p,
        DAT_SRQ_PARAM {
            ia_handle,
            srq_state,
            pz_handle,
            max_recv_dtos,
            max_recv_iov,
            low_watermark,
            available_dto_count,
            outstanding_dto_count,
        }
    );
    layout!(p, DAT_PZ_PARAM { ia_handle });
    layout!(
        p,
        DAT_PSP_PARAM {
            ia_handle,
            conn_qual,
            evd_handle,
            psp_flags
        }
    );
    layout!(
        p,
        DAT_RSP_PARAM {
            ia_handle,
            conn_qual,
            evd_handle,
            ep_handle
        }
    );
    layout!(
        p,
        DAT_CR_PARAM {
            remote_ia_address_ptr,
            remote_port_qual,
            private_data_size,
            private_data,
            local_ep_handle,
        }
    );
    layout!(
        p,
        DAT_DTO_COMPLETION_EVENT_DATA {
            ep_handle,
            user_cookie,
            status,
            transfered_length,
            operation,
            rmr_context,
        }
    );
    layout!(
        p,
        DAT_RMR_BIND_COMPLETION_EVENT_DATA {
            rmr_handle,
            user_cookie,
            status
        }
    );
    layout!(
        p,
        DAT_CR_ARRIVAL_EVENT_DATA {
            sp_handle,
            local_ia_address_ptr,
            conn_qual,
            cr_handle,
            truncate_flag,
        }
    );
    layout!(
        p,
        DAT_CONNECTION_EVENT_DATA {
            ep_handle,
            private_data_size,
            private_data
        }
    );
    layout!(p, DAT_ASYNCH_ERROR_EVENT_DATA { dat_handle, reason });
    p.size("DAT_EVENT_DATA", size_of::<DAT_EVENT_DATA>());
    layout!(
        p,
        DAT_EVENT {
            event_number,
            evd_handle,
            event_data,
            event_extension_data
        }
    );
    layout!(
        p,
        DAT_EVD_PARAM {
            ia_handle,
            evd_qlen,
            evd_state,
            cno_handle,
            evd_flags
        }
    );
    layout!(
        p,
        DAT_OS_WAIT_PROXY_AGENT {
            instance_data,
            proxy_agent_func
        }
    );
    p.size(
        "DAT_REGION_DESCRIPTION",
        size_of::<DAT_REGION_DESCRIPTION>(),
    );
    layout!(
        p,
        DAT_LMR_PARAM {
            ia_handle,
            mem_type,
            region_desc,
            length,
            pz_handle,
            mem_priv,
            va_type,
            lmr_context,
            rmr_context,
            registered_size,
            registered_address,
        }
    );
    layout!(
        p,
        DAT_RMR_PARAM {
            ia_handle,
            pz_handle,
            lmr_triplet,
            mem_priv,
            rmr_context,
            rmr_scope,
            va_type,
        }
    );
    layout!(
        p,
        DAT_CNO_PARAM {
            ia_handle,
            proxy_type,
            proxy
        }
    );
    layout!(
        p,
        DAT_IA_ATTR {
            adapter_name,
            vendor_name,
            hardware_version_major,
            hardware_version_minor,
            firmware_version_major,
            firmware_version_minor,
            ia_address_ptr,
            max_eps,
            max_dto_per_ep,
            max_rdma_read_per_ep_in,
            max_rdma_read_per_ep_out,
            max_evds,
            max_evd_qlen,
            max_iov_segments_per_dto,
            max_lmrs,
            max_lmr_block_size,
            max_lmr_virtual_address,
            max_pzs,
            max_message_size,
            max_rdma_size,
            max_rmrs,
            max_rmr_target_address,
            max_srqs,
            max_ep_per_srq,
            max_recv_per_srq,
            max_iov_segments_per_rdma_read,
            max_iov_segments_per_rdma_write,
            max_rdma_read_in,
            max_rdma_read_out,
            max_rdma_read_per_ep_in_guaranteed,
            max_rdma_read_per_ep_out_guaranteed,
            zb_supported,
            extension_supported,
            extension_version,
            num_transport_attr,
            transport_attr,
            num_vendor_attr,
            vendor_attr,
        }
    );
    layout!(
        p,
        DAT_PROVIDER_ATTR {
            provider_name,
            provider_version_major,
            provider_version_minor,
            dapl_version_major,
            dapl_version_minor,
            lmr_mem_types_supported,
            iov_ownership_on_return,
            dat_qos_supported,
            completion_flags_supported,
            is_thread_safe,
            max_private_data_size,
            supports_multipath,
            ep_creator,
            pz_support,
            optimal_buffer_alignment,
            evd_stream_merging_supported,
            srq_supported,
            srq_watermarks_supported,
            srq_ep_pz_difference_supported,
            srq_info_supported,
            ep_recv_info_supported,
            lmr_sync_req,
            dto_async_return_guaranteed,
            rdma_write_for_rdma_read_req,
            rdma_read_lmr_rmr_context_exposure,
            rmr_scope_supported,
            is_signal_safe,
            ha_supported,
            ha_loadbalancing,
            num_provider_specific_attr,
            provider_specific_attr,
        }
    );
    layout!(
        p,
        DAT_PROVIDER {
            device_name,
            extension
        }
    );
    // Every slot, by its header name, at its index in the table.
    let funcs = offset_of!(DAT_PROVIDER, funcs);
    for (i, n) in NAMES.iter().enumerate() {
        p.off("DAT_PROVIDER", &format!("{n}_func"), funcs + 8 * i);
    }

    let dir = std::env::temp_dir().join(format!("softrdma-dat-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("probe.c");
    let bin = dir.join("probe");
    std::fs::write(
        &src,
        format!(
            "#include <stddef.h>\n#include <stdio.h>\n#include <dat2/udat.h>\n\
             #include <dat2/udat_redirection.h>\n#include <dat2/dat_registry.h>\n\
             int main(void) {{\n{}return 0;\n}}\n",
            p.c
        ),
    )
    .unwrap();
    let cc = Command::new("cc").arg("-o").arg(&bin).arg(&src).output();
    let cc = match cc {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIPPED: no C compiler ({e})");
            return;
        }
    };
    assert!(
        cc.status.success(),
        "probe does not compile: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(&bin).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let c: HashMap<&str, usize> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    let mut bad = Vec::new();
    for (k, v) in &p.rust {
        match c.get(k.as_str()) {
            Some(cv) if cv == v => {}
            other => bad.push(format!("{k}: C {other:?}, Rust {v}")),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
    assert_eq!(c["DAT_PROVIDER"], 648);
    assert_eq!(c["DAT_EVENT"], 120);
    assert!(p.rust.len() > 250);
}
