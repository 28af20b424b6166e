/* Type 2 memory windows, in one process over loopback: a server region
 * registered with MW_BIND only (no remote access of its own), a window
 * bound over 256 bytes of it by posting IBV_WR_BIND_MW on the server's QP
 * with the rkey the application chose (ibv_inc_rkey); an rkey naming
 * another window is refused; the client's RDMA Write through the window's
 * rkey lands; the window invalidated and bound again through ibv_wr_bind_mw
 * (ibv_qp_ex) answers to its new rkey only; a Write that runs past the
 * window's end is refused. Type 1 windows: EOPNOTSUPP. Prints "ok <case>"
 * lines; exits 1 at the first failure. */
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
	/* The server's region grants no remote access itself: only windows. */
	struct ibv_mr *smr = ibv_reg_mr(pd, sbuf, LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
	CHECK(pd && ccq && scq && cmr && smr, "pd, cqs, mrs", "-");

	errno = 0;
	CHECK(ibv_alloc_mw(pd, IBV_MW_TYPE_1) == NULL && errno == EOPNOTSUPP, "type 1 window: EOPNOTSUPP", "-");
	struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
	CHECK(mw && mw->type == IBV_MW_TYPE_2 && mw->pd == pd, "alloc type 2 window", "-");

	struct rdma_conn_param cp = { .responder_resources = 1, .initiator_depth = 1 };
	sid = connect_client(ch, cid, pd, ccq, &cp);
	struct ibv_qp_init_attr_ex sa = { .send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
		.send_ops_flags = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV };
	CHECK(rdma_create_qp_ex(sid, &sa) == 0, "server qp (ibv_qp_ex with BIND_MW)", "-");
	struct ibv_qp_ex *sqx = ibv_qp_to_qp_ex(sid->qp);
	CHECK(sqx, "ibv_qp_to_qp_ex", "-");
	accept_established(ch, sid, &cp);

	/* Bind the window to sbuf[1024, 1024+256) for remote write. */
	uint32_t before = mw->rkey;
	struct ibv_send_wr bw = { .wr_id = 42, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED }, *bad;
	bw.bind_mw.mw = mw;
	bw.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
	bw.bind_mw.bind_info.mr = smr;
	bw.bind_mw.bind_info.addr = (uintptr_t)sbuf + 1024;
	bw.bind_mw.bind_info.length = 256;
	bw.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
	CHECK(ibv_post_send(sid->qp, &bw, &bad) == 0, "post IBV_WR_BIND_MW", "-");
	struct ibv_wc wc = wait_wc(scq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 42,
	      "bind completion", "status %d opcode %d", wc.status, wc.opcode);
	CHECK(mw->rkey == ibv_inc_rkey(before), "window has the rkey the application chose",
	      "before %#x after %#x", before, mw->rkey);

	/* An rkey whose index is not the window's is refused at post. */
	struct ibv_send_wr bad_bw = bw;
	bad_bw.bind_mw.rkey = ibv_inc_rkey(mw->rkey) ^ 0x100;
	CHECK(ibv_post_send(sid->qp, &bad_bw, &bad) == EINVAL && bad == &bad_bw, "bind with another window's rkey: EINVAL", "-");

	/* The client writes through the window. */
	strcpy(cbuf, "through the window");
	struct ibv_sge sge = { .addr = (uintptr_t)cbuf, .length = 19, .lkey = cmr->lkey };
	struct ibv_send_wr w = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED };
	w.wr.rdma.remote_addr = (uintptr_t)sbuf + 1024 + 16;
	w.wr.rdma.rkey = mw->rkey;
	CHECK(ibv_post_send(cid->qp, &w, &bad) == 0, "write through the window", "-");
	wc = wait_wc(ccq);
	CHECK(wc.status == IBV_WC_SUCCESS, "write completed", "status %d", wc.status);
	for (int i = 0; i < 100000 && strcmp(sbuf + 1024 + 16, "through the window"); i++)
		usleep(10);
	CHECK(strcmp(sbuf + 1024 + 16, "through the window") == 0, "data placed in the window", "'%s'", sbuf + 1040);

	/* Invalidate the window, bind it again through ibv_wr_bind_mw with the
	 * next rkey: the new rkey works, the old one no longer does. */
	uint32_t old_rkey = mw->rkey;
	struct ibv_send_wr inv = { .wr_id = 43, .opcode = IBV_WR_LOCAL_INV, .send_flags = IBV_SEND_SIGNALED };
	inv.invalidate_rkey = mw->rkey;
	CHECK(ibv_post_send(sid->qp, &inv, &bad) == 0, "post IBV_WR_LOCAL_INV of the window", "-");
	wc = wait_wc(scq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 43, "invalidate completion", "status %d", wc.status);
	struct ibv_mw_bind_info bi = { .mr = smr, .addr = (uintptr_t)sbuf + 1024, .length = 256,
				       .mw_access_flags = IBV_ACCESS_REMOTE_WRITE };
	ibv_wr_start(sqx);
	sqx->wr_id = 44;
	sqx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_bind_mw(sqx, mw, ibv_inc_rkey(old_rkey), &bi);
	CHECK(ibv_wr_complete(sqx) == 0, "ibv_wr_bind_mw", "-");
	wc = wait_wc(scq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 44,
	      "ibv_wr_bind_mw completion", "status %d opcode %d", wc.status, wc.opcode);
	CHECK(mw->rkey == ibv_inc_rkey(old_rkey), "rebound window has the chosen rkey", "%#x", mw->rkey);
	strcpy(cbuf, "second bind");
	w.wr_id = 3;
	w.wr.rdma.rkey = mw->rkey;
	w.wr.rdma.remote_addr = (uintptr_t)sbuf + 1024 + 64;
	CHECK(ibv_post_send(cid->qp, &w, &bad) == 0, "write through the rebound window", "-");
	wc = wait_wc(ccq);
	CHECK(wc.status == IBV_WC_SUCCESS, "write completed", "status %d", wc.status);
	for (int i = 0; i < 100000 && strcmp(sbuf + 1024 + 64, "second bind"); i++)
		usleep(10);
	CHECK(strcmp(sbuf + 1024 + 64, "second bind") == 0, "data placed through the new rkey", "'%s'", sbuf + 1088);

	/* Past the window's end: the server refuses it with a Terminate (an
	 * iWARP Write has completed for its sender once sent, so the refusal
	 * shows as the server QP's access error event). */
	w.wr_id = 2;
	w.wr.rdma.rkey = mw->rkey;
	w.wr.rdma.remote_addr = (uintptr_t)sbuf + 1024 + 250;
	CHECK(ibv_post_send(cid->qp, &w, &bad) == 0, "write past the window", "-");
	int seen = 0;
	for (int i = 0; i < 4 && !seen; i++) {
		struct ibv_async_event e = next_event(ctx, 5000);
		if (e.event_type == -1)
			break;
		seen = e.event_type == IBV_EVENT_QP_ACCESS_ERR && e.element.qp == sid->qp;
		ibv_ack_async_event(&e);
	}
	CHECK(seen, "write past the window: access error on the server QP", "-");
	CHECK(memcmp(sbuf + 1024 + 250, "through", 6) != 0, "nothing placed past the window", "-");

	rdma_destroy_qp(cid);
	rdma_destroy_qp(sid);
	CHECK(ibv_dealloc_mw(mw) == 0, "dealloc_mw", "-");
	printf("all ok\n");
	return 0;
}
