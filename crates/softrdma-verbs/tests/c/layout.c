/* Prints the sizes and field offsets of the rdma-core structures that the
 * drop-in library mirrors, as "name value" lines, for tests/layout.rs. */
#include <stddef.h>
#include <stdio.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define S(t) printf("%s %zu\n", #t, sizeof(struct t))
#define O(t, f) printf("%s.%s %zu\n", #t, #f, offsetof(struct t, f))

int main(void)
{
	S(ibv_device); O(ibv_device, node_type); O(ibv_device, transport_type);
	O(ibv_device, name); O(ibv_device, dev_name); O(ibv_device, dev_path); O(ibv_device, ibdev_path);
	S(ibv_context); O(ibv_context, ops); O(ibv_context, cmd_fd); O(ibv_context, async_fd);
	O(ibv_context, num_comp_vectors); O(ibv_context, mutex); O(ibv_context, abi_compat);
	printf("ops.poll_cq %zu\n", offsetof(struct ibv_context_ops, poll_cq));
	printf("ops.req_notify_cq %zu\n", offsetof(struct ibv_context_ops, req_notify_cq));
	printf("ops.post_srq_recv %zu\n", offsetof(struct ibv_context_ops, post_srq_recv));
	printf("ops.post_send %zu\n", offsetof(struct ibv_context_ops, post_send));
	printf("ops.post_recv %zu\n", offsetof(struct ibv_context_ops, post_recv));
	printf("ops.alloc_mw %zu\n", offsetof(struct ibv_context_ops, alloc_mw));
	printf("ops.bind_mw %zu\n", offsetof(struct ibv_context_ops, bind_mw));
	printf("ops.dealloc_mw %zu\n", offsetof(struct ibv_context_ops, dealloc_mw));
	S(verbs_context); O(verbs_context, query_port); O(verbs_context, create_cq_ex);
	O(verbs_context, query_device_ex); O(verbs_context, create_qp_ex); O(verbs_context, sz);
	O(verbs_context, context);
	S(ibv_pd); S(ibv_mr); O(ibv_mr, addr); O(ibv_mr, length); O(ibv_mr, lkey); O(ibv_mr, rkey);
	S(ibv_mw); O(ibv_mw, pd); O(ibv_mw, rkey); O(ibv_mw, handle); O(ibv_mw, type);
	S(ibv_comp_channel); O(ibv_comp_channel, fd); O(ibv_comp_channel, refcnt);
	S(ibv_cq); O(ibv_cq, channel); O(ibv_cq, cq_context); O(ibv_cq, cqe); O(ibv_cq, mutex);
	O(ibv_cq, cond); O(ibv_cq, comp_events_completed); O(ibv_cq, async_events_completed);
	S(ibv_srq); O(ibv_srq, pd); O(ibv_srq, handle); O(ibv_srq, events_completed);
	S(ibv_qp); O(ibv_qp, qp_num); O(ibv_qp, state); O(ibv_qp, qp_type); O(ibv_qp, mutex);
	O(ibv_qp, cond); O(ibv_qp, events_completed);
	S(ibv_qp_ex); O(ibv_qp_ex, comp_mask); O(ibv_qp_ex, wr_id); O(ibv_qp_ex, wr_flags);
	O(ibv_qp_ex, wr_atomic_cmp_swp); O(ibv_qp_ex, wr_rdma_write); O(ibv_qp_ex, wr_send);
	O(ibv_qp_ex, wr_set_inline_data); O(ibv_qp_ex, wr_set_sge); O(ibv_qp_ex, wr_set_sge_list);
	O(ibv_qp_ex, wr_start); O(ibv_qp_ex, wr_complete); O(ibv_qp_ex, wr_abort);
	O(ibv_qp_ex, wr_atomic_write);
	S(ibv_sge); S(ibv_recv_wr); S(ibv_send_wr); O(ibv_send_wr, opcode); O(ibv_send_wr, send_flags);
	O(ibv_send_wr, imm_data); O(ibv_send_wr, wr.rdma.remote_addr); O(ibv_send_wr, wr.rdma.rkey);
	O(ibv_send_wr, wr.atomic.compare_add); O(ibv_send_wr, wr.atomic.swap); O(ibv_send_wr, wr.atomic.rkey);
	O(ibv_send_wr, qp_type); O(ibv_send_wr, bind_mw);
	S(ibv_wc); O(ibv_wc, status); O(ibv_wc, opcode); O(ibv_wc, byte_len); O(ibv_wc, imm_data);
	O(ibv_wc, qp_num); O(ibv_wc, wc_flags); O(ibv_wc, sl);
	S(ibv_qp_init_attr); O(ibv_qp_init_attr, cap); O(ibv_qp_init_attr, qp_type); O(ibv_qp_init_attr, sq_sig_all);
	S(ibv_qp_init_attr_ex); O(ibv_qp_init_attr_ex, comp_mask); O(ibv_qp_init_attr_ex, pd);
	O(ibv_qp_init_attr_ex, create_flags); O(ibv_qp_init_attr_ex, send_ops_flags);
	S(ibv_qp_attr); O(ibv_qp_attr, cap); O(ibv_qp_attr, ah_attr); O(ibv_qp_attr, alt_ah_attr);
	O(ibv_qp_attr, max_rd_atomic); O(ibv_qp_attr, max_dest_rd_atomic); O(ibv_qp_attr, rate_limit);
	S(ibv_device_attr); O(ibv_device_attr, node_guid); O(ibv_device_attr, max_qp); O(ibv_device_attr, atomic_cap);
	O(ibv_device_attr, max_srq_sge); O(ibv_device_attr, max_pkeys); O(ibv_device_attr, phys_port_cnt);
	S(ibv_port_attr); O(ibv_port_attr, gid_tbl_len); O(ibv_port_attr, lid); O(ibv_port_attr, link_layer);
	O(ibv_port_attr, flags); O(ibv_port_attr, port_cap_flags2);
	S(ibv_gid_entry); S(ibv_async_event); S(ibv_srq_init_attr);
	S(rdma_cm_id); O(rdma_cm_id, qp); O(rdma_cm_id, route); O(rdma_cm_id, ps); O(rdma_cm_id, port_num);
	O(rdma_cm_id, event); O(rdma_cm_id, send_cq); O(rdma_cm_id, recv_cq); O(rdma_cm_id, srq);
	O(rdma_cm_id, pd); O(rdma_cm_id, qp_type);
	S(rdma_route); O(rdma_route, path_rec); O(rdma_route, num_paths);
	S(rdma_cm_event); O(rdma_cm_event, event); O(rdma_cm_event, status); O(rdma_cm_event, param);
	S(rdma_conn_param); O(rdma_conn_param, private_data_len); O(rdma_conn_param, responder_resources);
	O(rdma_conn_param, initiator_depth); O(rdma_conn_param, qp_num);
	S(rdma_addrinfo); O(rdma_addrinfo, ai_src_addr); O(rdma_addrinfo, ai_dst_addr); O(rdma_addrinfo, ai_next);
	return 0;
}
