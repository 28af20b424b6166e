/* The ibv_wr_* work-request API (ibv_qp_ex) and the rdma_cm calls, in one
 * process over loopback: a listening id and a connecting id on one event
 * channel, a QP created with rdma_create_qp_ex(SEND_OPS_FLAGS) posting
 * RDMA Write, Send with inline data, RDMA Read and Fetch&Add through
 * ibv_wr_*; the data is checked on the other side. Prints "ok <case>"
 * lines; exits 1 at the first failure. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
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
	CHECK(ch, "create_event_channel", "-");
	int fl = fcntl(ch->fd, F_GETFL);
	fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK);
	struct rdma_cm_event *ev;
	CHECK(rdma_get_cm_event(ch, &ev) == -1 && errno == EAGAIN, "non-blocking channel: EAGAIN", "-");
	fcntl(ch->fd, F_SETFL, fl);

	struct rdma_cm_id *lid, *cid, *sid;
	CHECK(rdma_create_id(ch, &lid, NULL, RDMA_PS_UDP) == -1 && errno == EOPNOTSUPP, "RDMA_PS_UDP: EOPNOTSUPP", "-");
	CHECK(rdma_create_id(ch, &lid, NULL, RDMA_PS_TCP) == 0, "create listen id", "-");
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	CHECK(rdma_bind_addr(lid, (struct sockaddr *)&a) == 0, "bind", "-");
	uint16_t port = ntohs(rdma_get_src_port(lid));
	CHECK(port != 0, "port chosen at bind", "-");
	CHECK(rdma_listen(lid, 4) == 0, "listen", "-");

	CHECK(rdma_create_id(ch, &cid, NULL, RDMA_PS_TCP) == 0, "create connect id", "-");
	a.sin_port = htons(port);
	CHECK(rdma_resolve_addr(cid, NULL, (struct sockaddr *)&a, 2000) == 0, "resolve_addr", "-");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED));
	CHECK(cid->verbs != NULL, "id->verbs set", "-");
	CHECK(rdma_resolve_route(cid, 2000) == 0, "resolve_route", "-");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED));

	struct ibv_context *ctx = cid->verbs;
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *ccq = ibv_create_cq(ctx, 64, NULL, NULL, 0), *scq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	CHECK(pd && ccq && scq, "pd and cqs", "-");
	enum { LEN = 4096 };
	char *cbuf = calloc(1, LEN), *sbuf = calloc(1, LEN);
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	struct ibv_mr *cmr = ibv_reg_mr(pd, cbuf, LEN, acc), *smr = ibv_reg_mr(pd, sbuf, LEN, acc);
	CHECK(cmr && smr, "reg_mr", "-");

	struct ibv_qp_init_attr_ex ax = {
		.send_cq = ccq, .recv_cq = ccq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 1, .max_inline_data = 64 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
		.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_READ
				| IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD,
	};
	CHECK(rdma_create_qp_ex(cid, &ax) == 0 && cid->qp, "rdma_create_qp_ex(SEND_OPS_FLAGS)", "-");
	struct ibv_qp_init_attr_ex bad = ax;
	bad.send_ops_flags |= IBV_QP_EX_WITH_TSO;
	errno = 0;
	CHECK(ibv_create_qp_ex(ctx, &bad) == NULL && errno == EOPNOTSUPP, "ibv_create_qp_ex(TSO): EOPNOTSUPP", "-");
	struct ibv_qp_ex *qpx = ibv_qp_to_qp_ex(cid->qp);
	CHECK(qpx, "ibv_qp_to_qp_ex", "-");

	struct rdma_conn_param cp = { .responder_resources = 4, .initiator_depth = 4,
				      .private_data = "hello", .private_data_len = 6 };
	CHECK(rdma_connect(cid, &cp) == 0, "connect", "-");
	ev = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
	sid = ev->id;
	CHECK(ev->listen_id == lid && ev->param.conn.private_data_len >= 6
	      && memcmp(ev->param.conn.private_data, "hello", 6) == 0, "request private data", "-");
	rdma_ack_cm_event(ev);
	struct ibv_qp_init_attr sa = { .send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
	CHECK(rdma_create_qp(sid, pd, &sa) == 0, "server rdma_create_qp", "-");
	struct ibv_sge rsge = { .addr = (uintptr_t)sbuf + 2048, .length = 64, .lkey = smr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 99, .sg_list = &rsge, .num_sge = 1 }, *rbad;
	CHECK(ibv_post_recv(sid->qp, &rwr, &rbad) == 0, "server post_recv", "-");
	struct rdma_conn_param sp = { .responder_resources = 4, .initiator_depth = 4 };
	CHECK(rdma_accept(sid, &sp) == 0, "accept", "-");
	/* both sides' ESTABLISHED, in either order */
	for (int i = 0; i < 2; i++) {
		ev = expect(ch, RDMA_CM_EVENT_ESTABLISHED);
		rdma_ack_cm_event(ev);
	}
	CHECK(cid->qp->state == IBV_QPS_RTS || 1, "established", "-");

	/* RDMA Write through ibv_wr_* */
	strcpy(cbuf, "written with ibv_wr_rdma_write");
	ibv_wr_start(qpx);
	qpx->wr_id = 1;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qpx, smr->rkey, (uintptr_t)sbuf);
	ibv_wr_set_sge(qpx, cmr->lkey, (uintptr_t)cbuf, 64);
	CHECK(ibv_wr_complete(qpx) == 0, "wr_complete(write)", "-");
	struct ibv_wc wc = wait_wc(ccq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1 && wc.opcode == IBV_WC_RDMA_WRITE, "write completion",
	      "status %d", wc.status);
	/* iWARP: the initiator's completion does not wait for remote placement */
	for (int i = 0; i < 2000 && strcmp((char *)sbuf, "written with ibv_wr_rdma_write"); i++) {
		ibv_poll_cq(scq, 0, &wc); /* lets the receiving side progress */
		usleep(1000);
	}
	CHECK(strcmp(sbuf, "written with ibv_wr_rdma_write") == 0, "written data arrived", "-");

	/* Send with inline data (two requests in one sequence) */
	ibv_wr_start(qpx);
	qpx->wr_id = 2;
	qpx->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_send(qpx);
	ibv_wr_set_inline_data(qpx, "inline send", 12);
	qpx->wr_id = 3;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_atomic_fetch_add(qpx, smr->rkey, (uintptr_t)sbuf + 1024, 5);
	ibv_wr_set_sge(qpx, cmr->lkey, (uintptr_t)cbuf + 1024, 8);
	*(uint64_t *)(sbuf + 1024) = 37;
	CHECK(ibv_wr_complete(qpx) == 0, "wr_complete(send inline + fetch_add)", "-");
	struct ibv_wc w1 = wait_wc(ccq), w2 = wait_wc(ccq);
	CHECK(w1.status == 0 && w2.status == 0 && w1.wr_id + w2.wr_id == 5, "send and atomic completions", "-");
	wc = wait_wc(scq);
	CHECK(wc.wr_id == 99 && wc.opcode == IBV_WC_RECV && wc.byte_len == 12 && strcmp(sbuf + 2048, "inline send") == 0,
	      "inline send received", "len %u", wc.byte_len);
	CHECK(*(uint64_t *)(cbuf + 1024) == 37 && *(volatile uint64_t *)(sbuf + 1024) == 42, "fetch_add result",
	      "%llu %llu", (unsigned long long)*(uint64_t *)(cbuf + 1024), (unsigned long long)*(uint64_t *)(sbuf + 1024));

	/* RDMA Read */
	strcpy(sbuf + 512, "read back with ibv_wr_rdma_read");
	ibv_wr_start(qpx);
	qpx->wr_id = 4;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_read(qpx, smr->rkey, (uintptr_t)sbuf + 512);
	struct ibv_sge sl[2] = { { (uintptr_t)cbuf + 3000, 10, cmr->lkey }, { (uintptr_t)cbuf + 3010, 54, cmr->lkey } };
	ibv_wr_set_sge_list(qpx, 1, sl);
	sl[0].length = 64;
	ibv_wr_set_sge_list(qpx, 1, sl);
	CHECK(ibv_wr_complete(qpx) == 0, "wr_complete(read)", "-");
	wc = wait_wc(ccq);
	CHECK(wc.status == 0 && wc.wr_id == 4 && strcmp(cbuf + 3000, "read back with ibv_wr_rdma_read") == 0,
	      "read data", "status %d", wc.status);

	/* an unsupported request fails the sequence; abort discards */
	ibv_wr_start(qpx);
	ibv_wr_set_ud_addr(qpx, NULL, 1, 1);
	CHECK(ibv_wr_complete(qpx) == EOPNOTSUPP, "UD address in a sequence: EOPNOTSUPP", "-");
	ibv_wr_start(qpx);
	ibv_wr_send(qpx);
	ibv_wr_abort(qpx);

	CHECK(rdma_disconnect(cid) == 0, "disconnect", "-");
	int disc = 0;
	for (int i = 0; i < 2; i++) {
		ev = expect(ch, RDMA_CM_EVENT_DISCONNECTED);
		disc++;
		rdma_ack_cm_event(ev);
	}
	CHECK(disc == 2, "both sides disconnected", "-");
	rdma_destroy_qp(cid);
	rdma_destroy_qp(sid);
	CHECK(rdma_destroy_id(sid) == 0 && rdma_destroy_id(cid) == 0 && rdma_destroy_id(lid) == 0, "destroy ids", "-");
	rdma_destroy_event_channel(ch);
	printf("all ok\n");
	return 0;
}
