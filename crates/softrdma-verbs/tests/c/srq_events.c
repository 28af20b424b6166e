/* Asynchronous events of a shared receive queue, in one process over
 * loopback: the server QP takes its receives from an SRQ armed with
 * ibv_modify_srq(IBV_SRQ_LIMIT); the client's Sends consume them until
 * fewer than the limit are left, which must raise exactly one
 * IBV_EVENT_SRQ_LIMIT_REACHED naming the SRQ on the context's async fd.
 * Prints "ok <case>" lines; exits 1 at the first failure. */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "test_util.h"

int main(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *lid, *cid, *sid;
	listen_and_resolve(ch, &lid, &cid);

	struct ibv_context *ctx = cid->verbs;
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *ccq = ibv_create_cq(ctx, 64, NULL, NULL, 0), *scq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	enum { LEN = 4096 };
	char *cbuf = calloc(1, LEN), *sbuf = calloc(1, LEN);
	struct ibv_mr *cmr = ibv_reg_mr(pd, cbuf, LEN, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *smr = ibv_reg_mr(pd, sbuf, LEN, IBV_ACCESS_LOCAL_WRITE);
	CHECK(pd && ccq && scq && cmr && smr, "pd, cqs, mrs", "-");

	struct ibv_srq_init_attr si = { .srq_context = (void *)0x5eed, .attr = { .max_wr = 8, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	CHECK(srq, "create_srq", "-");
	for (int i = 0; i < 4; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)sbuf + 64 * i, .length = 64, .lkey = smr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1 }, *bad;
		CHECK(ibv_post_srq_recv(srq, &wr, &bad) == 0, "post_srq_recv", "%d", i);
	}
	struct ibv_srq_attr lim = { .srq_limit = 2 };
	CHECK(ibv_modify_srq(srq, &lim, IBV_SRQ_LIMIT) == 0, "arm the SRQ limit at 2", "-");

	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1 };
	sid = connect_client(ch, cid, pd, ccq, &cp);
	struct ibv_qp_init_attr sa = { .send_cq = scq, .recv_cq = scq, .srq = srq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_send_sge = 1 } };
	CHECK(rdma_create_qp(sid, pd, &sa) == 0, "server qp on the srq", "-");
	accept_established(ch, sid, &cp);

	/* Two receives consumed: 2 left, not fewer than the limit. */
	for (int i = 0; i < 3; i++) {
		snprintf(cbuf + 64 * i, 64, "message %d", i);
		struct ibv_sge sge = { .addr = (uintptr_t)cbuf + 64 * i, .length = 16, .lkey = cmr->lkey };
		struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
					  .send_flags = IBV_SEND_SIGNALED }, *bad;
		CHECK(ibv_post_send(cid->qp, &wr, &bad) == 0, "post_send", "%d", i);
		struct ibv_wc wc = wait_wc(scq);
		CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.wr_id == 100 + (uint64_t)i,
		      "receive from the srq", "status %d wr_id %llu", wc.status, (unsigned long long)wc.wr_id);
		wait_wc(ccq);
		if (i == 1) {
			struct ibv_async_event e = next_event(ctx, 200);
			CHECK(e.event_type == -1, "no event while 2 receives are left", "got %d", e.event_type);
		}
	}
	/* The third left 1 < 2: one SRQ_LIMIT_REACHED naming the SRQ. */
	struct ibv_async_event e = next_event(ctx, 5000);
	CHECK(e.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && e.element.srq == srq,
	      "IBV_EVENT_SRQ_LIMIT_REACHED on the srq", "type %d srq %p", e.event_type, (void *)e.element.srq);
	CHECK(e.element.srq->srq_context == (void *)0x5eed, "event carries the srq_context", "-");
	ibv_ack_async_event(&e);
	CHECK(srq->events_completed == 1, "ack counted on the srq", "%u", srq->events_completed);
	struct ibv_srq_attr q;
	CHECK(ibv_query_srq(srq, &q) == 0 && q.srq_limit == 0, "limit disarmed after the event", "limit %u", q.srq_limit);

	CHECK(rdma_disconnect(cid) == 0, "disconnect", "-");
	for (int i = 0; i < 2; i++)
		rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_DISCONNECTED));
	rdma_destroy_qp(cid);
	rdma_destroy_qp(sid);
	CHECK(ibv_destroy_srq(srq) == 0, "destroy_srq", "-");
	CHECK(rdma_destroy_id(sid) == 0 && rdma_destroy_id(cid) == 0 && rdma_destroy_id(lid) == 0, "destroy ids", "-");
	rdma_destroy_event_channel(ch);
	printf("all ok\n");
	return 0;
}
