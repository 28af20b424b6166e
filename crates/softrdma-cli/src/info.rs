//! `softrdma info`: the device's attributes, threads and defaults, like
//! `ibv_devinfo -v`.

use std::io::Write;

use serde_json::{Value, json};
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::qp::DEFAULT_CLOSE_TIMEOUT;
use softrdma_engine::{Device, QpInitAttr, QueuePair};

/// Why `softrdma info` failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InfoError {
    /// The device could not be opened or set up.
    #[error("device: {0}")]
    Device(String),
    /// Output failed.
    #[error("output: {0}")]
    Output(#[from] std::io::Error),
}

/// Everything `softrdma info` reports, as JSON.
pub fn device_info(dev: &Device) -> Result<Value, InfoError> {
    // The datamover threads start with the first QP: create one (and drop
    // it) so their CPUs can be reported.
    {
        let pd = dev.alloc_pd();
        let cq = dev
            .create_cq(1)
            .map_err(|e| InfoError::Device(e.to_string()))?;
        let _qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq))
            .map_err(|e| InfoError::Device(e.to_string()))?;
    }
    let a = dev.attr();
    let cfg = dev.config();
    let mpa = MpaConfig::default();
    let handlers: Vec<Value> = dev
        .handler_table()
        .iter()
        .map(|(id, cpu)| json!({"id": id.index(), "cpu": cpu}))
        .collect();
    let datamovers: Vec<Value> = dev
        .datamover_stats()
        .iter()
        .enumerate()
        .map(|(i, d)| json!({"id": i, "cpu": d.cpu}))
        .collect();
    Ok(json!({
        "device": dev.name(),
        "softrdma_version": env!("CARGO_PKG_VERSION"),
        "transport": "iWARP (MPA/DDP/RDMAP over TCP)",
        "attributes": {
            "fw_ver": a.fw_ver,
            "vendor_id": a.vendor_id,
            "max_mr_size": a.max_mr_size,
            "page_size": a.page_size,
            "max_qp": a.max_qp,
            "max_qp_wr": a.max_qp_wr,
            "max_sge": a.max_sge,
            "max_sge_rd": a.max_sge_rd,
            "max_inline_data": a.max_inline_data,
            "max_cq": a.max_cq,
            "max_cqe": a.max_cqe,
            "max_mr": a.max_mr,
            "max_pd": a.max_pd,
            "max_mw": a.max_mw,
            "max_qp_rd_atom": a.max_qp_rd_atom,
            "max_qp_init_rd_atom": a.max_qp_init_rd_atom,
            "max_srq": a.max_srq,
            "max_srq_wr": a.max_srq_wr,
            "max_srq_sge": a.max_srq_sge,
            "atomic_cap": if a.atomic_cap { "ATOMIC_HCA" } else { "ATOMIC_NONE" },
            "max_fast_reg_page_list_len": a.max_fast_reg_page_list_len,
        },
        "threads": {
            "pinned": cfg.pin_threads,
            "datamovers": datamovers,
            "completion_handlers": handlers,
            "slice_size": cfg.slice_size,
            "force_datamover": cfg.force_datamover,
            "poll_driven_receive": cfg.poll_driven_receive,
        },
        "defaults": {
            "mpa_revision": mpa.revision,
            "mpa_enhanced_ird_ord": mpa.revision == 2,
            "crc": format!("{:?}", mpa.crc),
            "markers": false,
            "ird": mpa.ird,
            "ord": mpa.ord,
            "private_data_cap": mpa.max_private_data,
            "peer_to_peer_rtr": mpa.peer_to_peer.is_some(),
            "close_timeout_ms": DEFAULT_CLOSE_TIMEOUT.as_millis() as u64,
        },
    }))
}

/// Runs `softrdma info`.
pub fn run_info(json: bool, out: &mut dyn Write) -> Result<(), InfoError> {
    let dev = Device::open_default().map_err(|e| InfoError::Device(e.to_string()))?;
    let v = device_info(&dev)?;
    if json {
        writeln!(out, "{v}")?;
        return Ok(());
    }
    writeln!(
        out,
        "hca_id:\t{}\n\ttransport:\t\t\t{}\n\tsoftrdma version:\t\t{}",
        v["device"].as_str().unwrap_or(""),
        v["transport"].as_str().unwrap_or(""),
        v["softrdma_version"].as_str().unwrap_or("")
    )?;
    for section in ["attributes", "threads", "defaults"] {
        writeln!(out, "\t{section}:")?;
        if let Some(map) = v[section].as_object() {
            for (k, val) in map {
                let shown = match val {
                    Value::Array(items) => items
                        .iter()
                        .map(|i| format!("#{} on CPU {}", i["id"], i["cpu"]))
                        .collect::<Vec<_>>()
                        .join(", "),
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                writeln!(out, "\t\t{k:<28} {shown}")?;
            }
        }
    }
    Ok(())
}
