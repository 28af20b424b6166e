//! The C types of DAT 2.0 as `/usr/include/dat2` defines them on
//! x86-64 Linux with `DAT_EXTENSIONS` (the layout test compares every
//! size and offset with the headers).

#![allow(missing_docs, non_camel_case_types, missing_debug_implementations)]

use std::ffi::{c_char, c_int, c_void};

pub type DAT_RETURN = u32;
pub type DAT_HANDLE = *mut c_void;
pub type DAT_COUNT = c_int;
pub type DAT_TIMEOUT = u32;

pub const DAT_NAME_MAX_LENGTH: usize = 256;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_NAMED_ATTR {
    pub name: *const c_char,
    pub value: *const c_char,
}

#[repr(C)]
#[derive(Debug)]
pub struct DAT_PROVIDER_INFO {
    pub ia_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub dapl_version_major: u32,
    pub dapl_version_minor: u32,
    pub is_thread_safe: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_LMR_TRIPLET {
    pub virtual_address: u64,
    pub segment_length: u32,
    pub lmr_context: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_RMR_TRIPLET {
    pub virtual_address: u64,
    pub segment_length: u32,
    pub rmr_context: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_EP_ATTR {
    pub service_type: u32,
    pub max_message_size: u32,
    pub max_rdma_size: u32,
    pub qos: u32,
    pub recv_completion_flags: u32,
    pub request_completion_flags: u32,
    pub max_recv_dtos: DAT_COUNT,
    pub max_request_dtos: DAT_COUNT,
    pub max_recv_iov: DAT_COUNT,
    pub max_request_iov: DAT_COUNT,
    pub max_rdma_read_in: DAT_COUNT,
    pub max_rdma_read_out: DAT_COUNT,
    pub srq_soft_hw: DAT_COUNT,
    pub max_rdma_read_iov: DAT_COUNT,
    pub max_rdma_write_iov: DAT_COUNT,
    pub ep_transport_specific_count: DAT_COUNT,
    pub ep_transport_specific: *mut DAT_NAMED_ATTR,
    pub ep_provider_specific_count: DAT_COUNT,
    pub ep_provider_specific: *mut DAT_NAMED_ATTR,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_COMM {
    pub domain: c_int,
    pub type_: c_int,
    pub protocol: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_EP_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub ep_state: u32,
    pub comm: DAT_COMM,
    pub local_ia_address_ptr: *mut libc::sockaddr,
    pub local_port_qual: u64,
    pub remote_ia_address_ptr: *mut libc::sockaddr,
    pub remote_port_qual: u64,
    pub pz_handle: DAT_HANDLE,
    pub recv_evd_handle: DAT_HANDLE,
    pub request_evd_handle: DAT_HANDLE,
    pub connect_evd_handle: DAT_HANDLE,
    pub srq_handle: DAT_HANDLE,
    pub ep_attr: DAT_EP_ATTR,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_SRQ_ATTR {
    pub max_recv_dtos: DAT_COUNT,
    pub max_recv_iov: DAT_COUNT,
    pub low_watermark: DAT_COUNT,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_SRQ_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub srq_state: u32,
    pub pz_handle: DAT_HANDLE,
    pub max_recv_dtos: DAT_COUNT,
    pub max_recv_iov: DAT_COUNT,
    pub low_watermark: DAT_COUNT,
    pub available_dto_count: DAT_COUNT,
    pub outstanding_dto_count: DAT_COUNT,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_PZ_PARAM {
    pub ia_handle: DAT_HANDLE,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_PSP_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub conn_qual: u64,
    pub evd_handle: DAT_HANDLE,
    pub psp_flags: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_RSP_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub conn_qual: u64,
    pub evd_handle: DAT_HANDLE,
    pub ep_handle: DAT_HANDLE,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_CR_PARAM {
    pub remote_ia_address_ptr: *mut libc::sockaddr,
    pub remote_port_qual: u64,
    pub private_data_size: DAT_COUNT,
    pub private_data: *mut c_void,
    pub local_ep_handle: DAT_HANDLE,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_DTO_COMPLETION_EVENT_DATA {
    pub ep_handle: DAT_HANDLE,
    pub user_cookie: u64,
    pub status: u32,
    pub transfered_length: u32,
    pub operation: u32,
    pub rmr_context: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_RMR_BIND_COMPLETION_EVENT_DATA {
    pub rmr_handle: DAT_HANDLE,
    pub user_cookie: u64,
    pub status: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_CR_ARRIVAL_EVENT_DATA {
    pub sp_handle: DAT_HANDLE,
    pub local_ia_address_ptr: *mut libc::sockaddr,
    pub conn_qual: u64,
    pub cr_handle: DAT_HANDLE,
    pub truncate_flag: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_CONNECTION_EVENT_DATA {
    pub ep_handle: DAT_HANDLE,
    pub private_data_size: DAT_COUNT,
    pub private_data: *mut c_void,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_ASYNCH_ERROR_EVENT_DATA {
    pub dat_handle: DAT_HANDLE,
    pub reason: DAT_COUNT,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union DAT_EVENT_DATA {
    pub dto_completion_event_data: DAT_DTO_COMPLETION_EVENT_DATA,
    pub rmr_completion_event_data: DAT_RMR_BIND_COMPLETION_EVENT_DATA,
    pub cr_arrival_event_data: DAT_CR_ARRIVAL_EVENT_DATA,
    pub connect_event_data: DAT_CONNECTION_EVENT_DATA,
    pub asynch_error_event_data: DAT_ASYNCH_ERROR_EVENT_DATA,
    pub software_event_data: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_EVENT {
    pub event_number: u32,
    pub evd_handle: DAT_HANDLE,
    pub event_data: DAT_EVENT_DATA,
    pub event_extension_data: [u64; 8],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_EVD_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub evd_qlen: DAT_COUNT,
    pub evd_state: u32,
    pub cno_handle: DAT_HANDLE,
    pub evd_flags: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_OS_WAIT_PROXY_AGENT {
    pub instance_data: *mut c_void,
    pub proxy_agent_func: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union DAT_REGION_DESCRIPTION {
    pub for_va: *mut c_void,
    pub for_lmr_handle: DAT_HANDLE,
    pub for_shared_memory: [*mut c_void; 2],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_LMR_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub mem_type: u32,
    pub region_desc: DAT_REGION_DESCRIPTION,
    pub length: u64,
    pub pz_handle: DAT_HANDLE,
    pub mem_priv: u32,
    pub va_type: u32,
    pub lmr_context: u32,
    pub rmr_context: u32,
    pub registered_size: u64,
    pub registered_address: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_RMR_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub pz_handle: DAT_HANDLE,
    pub lmr_triplet: DAT_LMR_TRIPLET,
    pub mem_priv: u32,
    pub rmr_context: u32,
    pub rmr_scope: u32,
    pub va_type: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union DAT_CNO_PROXY {
    pub agent: DAT_OS_WAIT_PROXY_AGENT,
    pub fd: c_int,
    pub none: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_CNO_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub proxy_type: u32,
    pub proxy: DAT_CNO_PROXY,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_IA_ATTR {
    pub adapter_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub vendor_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub hardware_version_major: u32,
    pub hardware_version_minor: u32,
    pub firmware_version_major: u32,
    pub firmware_version_minor: u32,
    pub ia_address_ptr: *mut libc::sockaddr,
    pub max_eps: DAT_COUNT,
    pub max_dto_per_ep: DAT_COUNT,
    pub max_rdma_read_per_ep_in: DAT_COUNT,
    pub max_rdma_read_per_ep_out: DAT_COUNT,
    pub max_evds: DAT_COUNT,
    pub max_evd_qlen: DAT_COUNT,
    pub max_iov_segments_per_dto: DAT_COUNT,
    pub max_lmrs: DAT_COUNT,
    pub max_lmr_block_size: u32,
    pub max_lmr_virtual_address: u64,
    pub max_pzs: DAT_COUNT,
    pub max_message_size: u32,
    pub max_rdma_size: u32,
    pub max_rmrs: DAT_COUNT,
    pub max_rmr_target_address: u64,
    pub max_srqs: DAT_COUNT,
    pub max_ep_per_srq: DAT_COUNT,
    pub max_recv_per_srq: DAT_COUNT,
    pub max_iov_segments_per_rdma_read: DAT_COUNT,
    pub max_iov_segments_per_rdma_write: DAT_COUNT,
    pub max_rdma_read_in: DAT_COUNT,
    pub max_rdma_read_out: DAT_COUNT,
    pub max_rdma_read_per_ep_in_guaranteed: u32,
    pub max_rdma_read_per_ep_out_guaranteed: u32,
    pub zb_supported: u32,
    pub extension_supported: u32,
    pub extension_version: DAT_COUNT,
    pub num_transport_attr: DAT_COUNT,
    pub transport_attr: *mut DAT_NAMED_ATTR,
    pub num_vendor_attr: DAT_COUNT,
    pub vendor_attr: *mut DAT_NAMED_ATTR,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DAT_PROVIDER_ATTR {
    pub provider_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub provider_version_major: u32,
    pub provider_version_minor: u32,
    pub dapl_version_major: u32,
    pub dapl_version_minor: u32,
    pub lmr_mem_types_supported: u32,
    pub iov_ownership_on_return: u32,
    pub dat_qos_supported: u32,
    pub completion_flags_supported: u32,
    pub is_thread_safe: u32,
    pub max_private_data_size: DAT_COUNT,
    pub supports_multipath: u32,
    pub ep_creator: u32,
    pub pz_support: u32,
    pub optimal_buffer_alignment: u32,
    pub evd_stream_merging_supported: [[u32; 6]; 6],
    pub srq_supported: u32,
    pub srq_watermarks_supported: DAT_COUNT,
    pub srq_ep_pz_difference_supported: u32,
    pub srq_info_supported: DAT_COUNT,
    pub ep_recv_info_supported: DAT_COUNT,
    pub lmr_sync_req: u32,
    pub dto_async_return_guaranteed: u32,
    pub rdma_write_for_rdma_read_req: u32,
    pub rdma_read_lmr_rmr_context_exposure: u32,
    pub rmr_scope_supported: u32,
    pub is_signal_safe: u32,
    pub ha_supported: u32,
    pub ha_loadbalancing: u32,
    pub num_provider_specific_attr: DAT_COUNT,
    pub provider_specific_attr: *mut DAT_NAMED_ATTR,
}

/// `struct dat_provider`: the IA name, the extension pointer and the 79
/// entry points in header order (see [`crate::table`]).
#[repr(C)]
#[derive(Debug)]
pub struct DAT_PROVIDER {
    pub device_name: *const c_char,
    pub extension: *mut c_void,
    pub funcs: [*const c_void; crate::table::SLOTS],
}
