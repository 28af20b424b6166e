/* Shared by the C test programs that connect two ids over loopback in one
 * process: CHECK (prints "ok <name>" or "FAIL <name>: ..." and exits 1),
 * the next CM event of a type, a listening id plus a connecting id resolved
 * to it, the next completion, the next async event. */
#ifndef SOFTRDMA_VERBS_TEST_UTIL_H
#define SOFTRDMA_VERBS_TEST_UTIL_H
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define CHECK(cond, name, ...) do { \
	if (!(cond)) { printf("FAIL %s: ", name); printf(__VA_ARGS__); printf(" (errno %d)\n", errno); exit(1); } \
	printf("ok %s\n", name); fflush(stdout); } while (0)

static inline struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type t)
{
	struct rdma_cm_event *ev;
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	if (poll(&p, 1, 10000) != 1) { printf("FAIL no event (wanted %s)\n", rdma_event_str(t)); exit(1); }
	if (rdma_get_cm_event(ch, &ev)) { printf("FAIL rdma_get_cm_event %d\n", errno); exit(1); }
	if (ev->event != t) {
		printf("FAIL got %s (status %d), wanted %s\n", rdma_event_str(ev->event), ev->status, rdma_event_str(t));
		exit(1);
	}
	printf("ok event %s\n", rdma_event_str(t));
	return ev;
}

/* On channel `ch`: a listening id on 127.0.0.1 (any port) and a connecting
 * id whose address and route are resolved to it. */
static inline void listen_and_resolve(struct rdma_event_channel *ch, struct rdma_cm_id **lid, struct rdma_cm_id **cid)
{
	CHECK(ch && rdma_create_id(ch, lid, NULL, RDMA_PS_TCP) == 0, "listen id", "-");
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	CHECK(rdma_bind_addr(*lid, (struct sockaddr *)&a) == 0 && rdma_listen(*lid, 4) == 0, "bind and listen", "-");
	a.sin_port = rdma_get_src_port(*lid);
	CHECK(rdma_create_id(ch, cid, NULL, RDMA_PS_TCP) == 0, "connect id", "-");
	CHECK(rdma_resolve_addr(*cid, NULL, (struct sockaddr *)&a, 2000) == 0, "resolve_addr", "-");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED));
	CHECK(rdma_resolve_route(*cid, 2000) == 0, "resolve_route", "-");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED));
}

static inline struct ibv_wc wait_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	for (int i = 0; i < 5000000; i++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n == 1)
			return wc;
		if (n < 0)
			break;
		if (i > 1000)
			usleep(10);
	}
	printf("FAIL no completion\n");
	exit(1);
}

/* The next async event other than COMM_EST, or type -1 after `ms`. */
static inline struct ibv_async_event next_event(struct ibv_context *ctx, int ms)
{
	struct ibv_async_event e;
	for (;;) {
		struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
		if (poll(&p, 1, ms) != 1) {
			e.event_type = -1;
			return e;
		}
		if (ibv_get_async_event(ctx, &e)) { printf("FAIL ibv_get_async_event %d\n", errno); exit(1); }
		if (e.event_type != IBV_EVENT_COMM_EST)
			return e;
		ibv_ack_async_event(&e);
	}
}

/* Client side of a connection to the listener on `ch`: an RC QP on `cid`
 * (16 sends, 4 receives, one SGE each, both completing on `cq`), then
 * rdma_connect with `cp`. Returns the id of the CONNECT_REQUEST. */
static inline struct rdma_cm_id *connect_client(struct rdma_event_channel *ch, struct rdma_cm_id *cid,
						struct ibv_pd *pd, struct ibv_cq *cq, struct rdma_conn_param *cp)
{
	struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
	CHECK(rdma_create_qp(cid, pd, &qa) == 0, "client qp", "-");
	CHECK(rdma_connect(cid, cp) == 0, "connect", "-");
	struct rdma_cm_event *ev = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
	struct rdma_cm_id *sid = ev->id;
	rdma_ack_cm_event(ev);
	return sid;
}

/* Server side: accepts `sid` with `cp`, then takes the ESTABLISHED events
 * of both ends. */
static inline void accept_established(struct rdma_event_channel *ch, struct rdma_cm_id *sid,
				      struct rdma_conn_param *cp)
{
	CHECK(rdma_accept(sid, cp) == 0, "accept", "-");
	for (int i = 0; i < 2; i++)
		rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ESTABLISHED));
}

#endif
