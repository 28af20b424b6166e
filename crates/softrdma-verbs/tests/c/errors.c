/* Error paths of the drop-in libibverbs, through the public API exactly as
 * an application calls it. Prints "ok <case>" per passed check; exits 1
 * at the first failure ("FAIL <case>: ..."). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define CHECK(cond, name, ...) do { \
	if (!(cond)) { printf("FAIL %s: ", name); printf(__VA_ARGS__); printf("\n"); exit(1); } \
	printf("ok %s\n", name); } while (0)

static volatile int destroyed;

static void *destroy_cq_thread(void *cq)
{
	int rc = ibv_destroy_cq(cq);
	destroyed = rc == 0 ? 1 : -1;
	return NULL;
}

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1 && list[0], "device list", "n=%d", n);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx, "open", "errno %d", errno);

	/* NULL arguments */
	errno = 0;
	CHECK(ibv_alloc_pd(NULL) == NULL && errno == EINVAL, "alloc_pd(NULL)", "errno %d", errno);
	struct ibv_device_attr da;
	CHECK(ibv_query_device(NULL, &da) == EINVAL, "query_device(NULL)", "-");
	CHECK(ibv_query_device(ctx, NULL) == EINVAL, "query_device(ctx, NULL)", "-");
	errno = 0;
	CHECK(ibv_create_cq(NULL, 16, NULL, NULL, 0) == NULL && errno == EINVAL, "create_cq(NULL)", "errno %d", errno);
	CHECK(ibv_dealloc_pd(NULL) == EINVAL, "dealloc_pd(NULL)", "-");
	CHECK(ibv_dereg_mr(NULL) == EINVAL, "dereg_mr(NULL)", "-");
	CHECK(ibv_destroy_qp(NULL) == EINVAL, "destroy_qp(NULL)", "-");
	errno = 0;
	CHECK(ibv_create_qp(NULL, NULL) == NULL && errno == EINVAL, "create_qp(NULL)", "errno %d", errno);
	union ibv_gid gid;
	CHECK(ibv_query_gid(ctx, 1, 999, &gid) != 0, "query_gid(bad index)", "-");
	CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0 && gid.raw[10] == 0xff && gid.raw[11] == 0xff
	      && gid.raw[12] == 127, "query_gid(0) is ::ffff:127.0.0.1", "-");
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.link_layer == IBV_LINK_LAYER_ETHERNET
	      && pa.state == IBV_PORT_ACTIVE, "query_port", "-");
	CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL, "query_port(2)", "-");
	CHECK(list[0]->transport_type == IBV_TRANSPORT_IWARP && list[0]->node_type == IBV_NODE_RNIC,
	      "iWARP RNIC", "-");

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd, "alloc_pd", "-");
	char *buf = calloc(1, 4096);
	errno = 0;
	CHECK(ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_ON_DEMAND) == NULL && errno == EOPNOTSUPP,
	      "reg_mr(ON_DEMAND) refused", "errno %d", errno);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
	CHECK(mr && mr->addr == buf && mr->length == 4096, "reg_mr(+RELAXED_ORDERING)", "errno %d", errno);

	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch && ch->fd >= 0, "create_comp_channel", "-");
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, ch, 0);
	CHECK(cq, "create_cq", "-");
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "destroy busy channel: EBUSY", "-");

	/* UD and UC are refused like on iWARP */
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	ia.qp_type = IBV_QPT_UD;
	errno = 0;
	CHECK(ibv_create_qp(pd, &ia) == NULL && errno == EOPNOTSUPP, "UD QP: EOPNOTSUPP", "errno %d", errno);
	ia.qp_type = IBV_QPT_UC;
	errno = 0;
	CHECK(ibv_create_qp(pd, &ia) == NULL && errno == EOPNOTSUPP, "UC QP: EOPNOTSUPP", "errno %d", errno);
	ia.qp_type = IBV_QPT_RC;
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	CHECK(qp && qp->qp_num != 0, "RC QP", "errno %d", errno);

	/* posting on a QP that is not connected */
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey };
	struct ibv_send_wr swr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
	int rc = ibv_post_send(qp, &swr, &bad);
	CHECK(rc == EINVAL && bad == &swr, "post_send in RESET: EINVAL, bad_wr set", "rc %d", rc);
	struct ibv_qp_attr qa = { .qp_state = IBV_QPS_RTS };
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == EINVAL, "RESET->RTS without a connection: EINVAL", "-");
	qa.qp_state = IBV_QPS_INIT;
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0, "RESET->INIT", "-");
	struct ibv_qp_init_attr qi;
	CHECK(ibv_query_qp(qp, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_INIT, "query_qp INIT", "-");

	/* O_NONBLOCK on the channel is honoured */
	fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	errno = 0;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EAGAIN, "get_cq_event non-blocking: EAGAIN",
	      "errno %d", errno);

	/* a flushed receive raises an event: readable fd, event, then destroy waits for the ack */
	struct ibv_recv_wr rwr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1 }, *rbad;
	CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0, "post_recv in INIT", "-");
	CHECK(ibv_req_notify_cq(cq, 0) == 0, "req_notify_cq", "-");
	qa.qp_state = IBV_QPS_ERR;
	CHECK(ibv_modify_qp(qp, &qa, IBV_QP_STATE) == 0, "-> ERR", "-");
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 5000) == 1 && (pfd.revents & POLLIN), "channel fd readable", "-");
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq, "get_cq_event", "-");
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(cq, 1, &wc) == 1 && wc.wr_id == 7 && wc.status == IBV_WC_WR_FLUSH_ERR,
	      "flushed receive", "status %d", wc.status);
	CHECK(ibv_destroy_qp(qp) == 0, "destroy_qp", "-");
	pthread_t t;
	pthread_create(&t, NULL, destroy_cq_thread, cq);
	usleep(200000);
	CHECK(destroyed == 0, "destroy_cq waits for unacknowledged events", "-");
	ibv_ack_cq_events(cq, 1);
	pthread_join(t, NULL);
	CHECK(destroyed == 1, "destroy_cq returns after the ack", "-");
	CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy_comp_channel", "-");
	CHECK(ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0, "dereg/dealloc", "-");
	CHECK(ibv_close_device(ctx) == 0, "close_device", "-");
	ibv_free_device_list(list);
	printf("all ok\n");
	return 0;
}
