/* Synchronous rdma_cm ids (created with a NULL event channel): every call
 * returns once its outcome is known. A server thread listens, takes the
 * request with rdma_get_request and accepts (returning when established);
 * the client resolves, connects (returning when established) and sends one
 * message the server receives. A connect to a port nobody listens on fails
 * with ECONNREFUSED. With SOFTRDMA_CONNECT_SETTLE_MS=N in the environment,
 * rdma_connect must take at least N ms (the active side holds its
 * ESTABLISHED event). Prints "ok <case>" lines; exits 1 at the first
 * failure. */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "test_util.h"

static struct rdma_cm_id *lid;
static char sbuf[64];

static void *server(void *arg)
{
	(void)arg;
	struct rdma_cm_id *sid;
	CHECK(rdma_get_request(lid, &sid) == 0 && sid, "rdma_get_request", "-");
	CHECK(sid->channel && sid->channel != lid->channel, "new id has a channel of its own", "-");
	struct ibv_qp_init_attr sa = { .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_pd *pd = ibv_alloc_pd(sid->verbs);
	CHECK(pd && rdma_create_qp(sid, pd, &sa) == 0, "server qp", "-");
	struct ibv_mr *mr = ibv_reg_mr(pd, sbuf, sizeof(sbuf), IBV_ACCESS_LOCAL_WRITE);
	struct ibv_sge sge = { .addr = (uintptr_t)sbuf, .length = sizeof(sbuf), .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1 }, *bad;
	CHECK(ibv_post_recv(sid->qp, &wr, &bad) == 0, "server post_recv", "-");
	CHECK(rdma_accept(sid, NULL) == 0, "rdma_accept returns established", "-");
	struct ibv_wc wc = wait_wc(sid->recv_cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 7 && strcmp(sbuf, "synchronous") == 0,
	      "server received the message", "status %d '%s'", wc.status, sbuf);
	return sid;
}

int main(void)
{
	struct rdma_cm_id *cid;
	CHECK(rdma_create_id(NULL, &lid, NULL, RDMA_PS_TCP) == 0 && lid->channel, "synchronous listen id", "-");
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	CHECK(rdma_bind_addr(lid, (struct sockaddr *)&a) == 0 && rdma_listen(lid, 4) == 0, "bind and listen", "-");
	a.sin_port = rdma_get_src_port(lid);
	pthread_t t;
	pthread_create(&t, NULL, server, NULL);

	CHECK(rdma_create_id(NULL, &cid, NULL, RDMA_PS_TCP) == 0, "synchronous connect id", "-");
	CHECK(rdma_resolve_addr(cid, NULL, (struct sockaddr *)&a, 2000) == 0 && cid->verbs, "resolve_addr returns resolved", "-");
	CHECK(rdma_resolve_route(cid, 2000) == 0, "resolve_route", "-");
	struct ibv_qp_init_attr ca = { .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_pd *pd = ibv_alloc_pd(cid->verbs);
	CHECK(pd && rdma_create_qp(cid, pd, &ca) == 0, "client qp", "-");
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	CHECK(rdma_connect(cid, NULL) == 0, "rdma_connect returns established", "-");
	clock_gettime(CLOCK_MONOTONIC, &t1);
	const char *settle = getenv("SOFTRDMA_CONNECT_SETTLE_MS");
	if (settle) {
		long ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
		CHECK(ms >= atol(settle), "connect held for SOFTRDMA_CONNECT_SETTLE_MS", "%ld ms < %s ms", ms, settle);
	}
	static char cbuf[64] = "synchronous";
	struct ibv_mr *mr = ibv_reg_mr(pd, cbuf, sizeof(cbuf), IBV_ACCESS_LOCAL_WRITE);
	struct ibv_sge sge = { .addr = (uintptr_t)cbuf, .length = 12, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	CHECK(ibv_post_send(cid->qp, &wr, &bad) == 0, "client post_send", "-");
	struct ibv_wc wc = wait_wc(cid->send_cq);
	CHECK(wc.status == IBV_WC_SUCCESS, "send completed", "status %d", wc.status);
	void *sid;
	pthread_join(t, &sid);

	CHECK(rdma_disconnect(cid) == 0, "disconnect", "-");
	rdma_destroy_qp(cid);
	rdma_destroy_qp(sid);
	CHECK(rdma_destroy_id(cid) == 0 && rdma_destroy_id(sid) == 0, "destroy connected ids", "-");
	CHECK(rdma_destroy_id(lid) == 0, "destroy listen id", "-");

	/* Nobody listens on the closed listener's port any more. */
	struct rdma_cm_id *rid;
	CHECK(rdma_create_id(NULL, &rid, NULL, RDMA_PS_TCP) == 0, "another synchronous id", "-");
	CHECK(rdma_resolve_addr(rid, NULL, (struct sockaddr *)&a, 2000) == 0
	      && rdma_resolve_route(rid, 2000) == 0, "resolve", "-");
	struct ibv_pd *pd2 = ibv_alloc_pd(rid->verbs);
	/* A fresh attr: rdma_create_qp wrote the client's (now destroyed) CQs
	 * into `ca`, as librdmacm does. */
	struct ibv_qp_init_attr ra = { .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
	CHECK(pd2 && rdma_create_qp(rid, pd2, &ra) == 0, "qp", "-");
	errno = 0;
	CHECK(rdma_connect(rid, NULL) == -1 && errno == ECONNREFUSED, "connect to a closed port: ECONNREFUSED", "-");
	rdma_destroy_qp(rid);
	CHECK(rdma_destroy_id(rid) == 0, "destroy refused id", "-");
	printf("all ok\n");
	return 0;
}
