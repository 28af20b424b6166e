/* Shared by the C test programs that connect two ids over loopback in one
 * process: CHECK (prints "ok <name>" or "FAIL <name>: ..." and exits 1),
 * the next CM event of a type, the next completion, the next async event. */
#ifndef SOFTRDMA_VERBS_TEST_UTIL_H
#define SOFTRDMA_VERBS_TEST_UTIL_H
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define CHECK(cond, name, ...) do { \
	if (!(cond)) { printf("FAIL %s: ", name); printf(__VA_ARGS__); printf(" (errno %d)\n", errno); exit(1); } \
	printf("ok %s\n", name); } while (0)

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type t)
{
	struct rdma_cm_event *ev;
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	if (poll(&p, 1, 10000) != 1) { printf("FAIL no event (wanted %s)\n", rdma_event_str(t)); exit(1); }
	if (rdma_get_cm_event(ch, &ev)) { printf("FAIL rdma_get_cm_event %d\n", errno); exit(1); }
	if (ev->event != t) {
		printf("FAIL got %s (status %d), wanted %s\n", rdma_event_str(ev->event), ev->status, rdma_event_str(t));
		exit(1);
	}
	return ev;
}

static struct ibv_wc wait_wc(struct ibv_cq *cq)
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
static struct ibv_async_event next_event(struct ibv_context *ctx, int ms)
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

#endif
