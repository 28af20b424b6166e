//! Both ends preloaded: connections are switched into sockets direct and
//! the interposed calls behave as the kernel's would (Python socket
//! programs, one process or a forked pair).

mod common;

use common::{compile_c, field, have_python, python, python_done};

/// Common prelude: a listener and a connected, offloaded pair (c: client,
/// s: server side). The server switches on its first use of the accepted
/// socket (here a select); the client's switch, begun in `connect`, is
/// finished on its first use.
const PAIR: &str = "import socket,os,sys,select,fcntl,termios,struct,signal,time,errno,threading\n\
l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(8)\n\
def connect():\n    r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',l.getsockname()[1])))); t.start()\n    s,_=l.accept(); select.select([],[s],[],5); t.join(); return r[0],s\n\
c,s=connect()\n";

/// Python: `free_port((family, host, v6only), ...)` binds a TCP socket to
/// each address on one port the kernel picks (the first address's) and
/// returns them, not listening, once that port was free for UDP on every
/// address as well (probed with a UDP socket bound and closed again). A
/// port the kernel gives a TCP socket may be held for UDP by a socket of
/// another process (a client's datagram socket), and one of UDP for TCP
/// (a connection in `TIME_WAIT`): a test that puts a twin or a UDP socket
/// of its own on a listener's port, or a listener on another one's port,
/// starts from a port free for both, or fails with `EADDRINUSE` on a busy
/// machine. `reuse`: `SO_REUSEADDR` on the TCP sockets.
const FREE_PORT: &str = r#"def free_port(*addrs, reuse=False):
    while True:
        ks=[]; P=0
        try:
            for fam,host,v6only in addrs:
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    k=socket.socket(fam,kind); ks.append(k)
                    if v6only is not None: k.setsockopt(socket.IPPROTO_IPV6,socket.IPV6_V6ONLY,v6only)
                    if reuse and kind==socket.SOCK_STREAM: k.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)
                    k.bind((host,P)); P=k.getsockname()[1]
        except OSError as e:
            for k in ks: k.close()
            if e.errno!=errno.EADDRINUSE: raise
            continue
        for k in ks:
            if k.type==socket.SOCK_DGRAM: k.close()
        return [k for k in ks if k.type==socket.SOCK_STREAM]
"#;

fn run(body: &str) -> Vec<String> {
    run_with(body, &[])
}

/// [`run`] with more environment variables.
fn run_with(body: &str, env: &[(&str, &str)]) -> Vec<String> {
    let script = format!("{PAIR}{FREE_PORT}{body}\nprint('DONE')\n");
    let mut all = vec![("SOFTRDMA_SOCKETS", "auto")];
    all.extend_from_slice(env);
    python_done(&script, &all)
}

#[test]
fn both_ends_preloaded_are_offloaded_and_byte_exact_each_way() {
    if !have_python() {
        return;
    }
    let lines = run("data=os.urandom(3_000_000)\n\
        def tx(): c.sendall(data); c.shutdown(socket.SHUT_WR)\n\
        t=threading.Thread(target=tx); t.start()\n\
        b=bytearray()\n\
        while True:\n    x=s.recv(70000)\n    if not x: break\n    b+=x\n\
        t.join(); assert bytes(b)==data\n\
        def back(): s.sendall(data[::-1]); s.close()\n\
        t=threading.Thread(target=back); t.start()\n\
        b=bytearray()\n\
        while True:\n    x=c.recv(1<<20)\n    if not x: break\n    b+=x\n\
        t.join(); assert bytes(b)==data[::-1]\n");
    assert_eq!(field(&lines[0], "offloaded"), "2", "{lines:?}");
}

#[test]
fn poll_select_and_epoll_see_offloaded_data_level_edge_and_oneshot() {
    if !have_python() {
        return;
    }
    run("s.setblocking(False)\n\
        p=select.poll(); p.register(s, select.POLLIN)\n\
        assert p.poll(100)==[], 'nothing yet'\n\
        c.sendall(b'0123456789')\n\
        assert p.poll(2000)==[(s.fileno(), select.POLLIN)]\n\
        r,w,_=select.select([s],[s],[],2); assert r==[s] and w==[s], (r,w)\n\
        e=select.epoll(); e.register(s.fileno(), select.EPOLLIN|select.EPOLLET)\n\
        assert e.poll(2)==[(s.fileno(), select.EPOLLIN)]\n\
        assert s.recv(5)==b'01234'\n\
        assert e.poll(0.2)==[], 'edge-triggered: no new edge'\n\
        assert s.recv(100)==b'56789'\n\
        try:\n    s.recv(1); raise SystemExit('expected EAGAIN')\n\
        except BlockingIOError: pass\n\
        c.sendall(b'ab')\n\
        assert e.poll(2)==[(s.fileno(), select.EPOLLIN)], 'a new edge once drained'\n\
        assert s.recv(100)==b'ab'\n\
        e.modify(s.fileno(), select.EPOLLIN|select.EPOLLONESHOT)\n\
        c.sendall(b'x'); assert e.poll(2)==[(s.fileno(), select.EPOLLIN)]\n\
        c.sendall(b'y'); assert e.poll(0.2)==[], 'one-shot: disarmed'\n\
        e.modify(s.fileno(), select.EPOLLIN|select.EPOLLONESHOT)\n\
        assert e.poll(2)==[(s.fileno(), select.EPOLLIN)]\n\
        assert s.recv(10)==b'xy'\n\
        e.unregister(s.fileno())\n\
        c.close(); assert p.poll(2)[0][1] & select.POLLIN; assert s.recv(10)==b''\n");
}

#[test]
fn descriptor_calls_keep_the_application_view() {
    if !have_python() {
        return;
    }
    run(
        "fl=fcntl.fcntl(s, fcntl.F_GETFL); assert not fl & os.O_NONBLOCK\n\
        s.setblocking(False); assert fcntl.fcntl(s, fcntl.F_GETFL) & os.O_NONBLOCK\n\
        s.setblocking(True); assert not fcntl.fcntl(s, fcntl.F_GETFL) & os.O_NONBLOCK\n\
        c.sendall(b'hello')\n\
        time.sleep(0.2)\n\
        n=struct.unpack('i', fcntl.ioctl(s, termios.FIONREAD, b'\\0\\0\\0\\0'))[0]; assert n==5, n\n\
        assert s.recv(5, socket.MSG_PEEK)==b'hello'\n\
        d=os.dup(s.fileno()); d2=fcntl.fcntl(s, fcntl.F_DUPFD, 0)\n\
        assert os.read(d, 2)==b'he'; assert os.read(d2, 3)==b'llo'\n\
        os.close(d); os.close(d2)\n\
        c.sendall(b'still'); assert s.recv(5)==b'still', 'alive after closing duplicates'\n\
        try:\n    s.setsockopt(socket.IPPROTO_TCP, 31, b'tls'); raise SystemExit('TCP_ULP accepted')\n\
        except OSError as x: assert x.errno==errno.ENOPROTOOPT, x\n\
        assert s.getpeername()==c.getsockname() and os.fstat(s.fileno()).st_mode & 0o170000 == 0o140000\n\
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        os.writev(c.fileno(), [b'ab', b'cd', b'ef'])\n\
        b1=bytearray(3); b2=bytearray(3); assert os.readv(s.fileno(), [b1,b2])==6 and b1+b2==b'abcdef'\n\
        c.sendmsg([b'msg', b'!']); assert s.recvmsg(10)[0]==b'msg!'\n",
    );
}

#[test]
fn sendfile_and_splice_copy_through_user_space() {
    if !have_python() {
        return;
    }
    run("import tempfile\n\
        f=tempfile.TemporaryFile(); data=os.urandom(300_000); f.write(data); f.flush()\n\
        n=0\n\
        while n<len(data): n+=os.sendfile(c.fileno(), f.fileno(), n, len(data)-n)\n\
        b=bytearray()\n\
        while len(b)<len(data): b+=s.recv(65536)\n\
        assert bytes(b)==data\n\
        f.seek(0); assert os.sendfile(c.fileno(), f.fileno(), None, 1000)==1000 and f.tell()==1000\n\
        assert s.recv(1000, socket.MSG_WAITALL)==data[:1000]\n\
        r,w=os.pipe(); os.write(w, b'through a pipe')\n\
        assert os.splice(r, c.fileno(), 14)==14\n\
        assert s.recv(14, socket.MSG_WAITALL)==b'through a pipe'\n\
        c.sendall(b'back'); time.sleep(0.1)\n\
        assert os.splice(s.fileno(), w, 4)==4 and os.read(r, 4)==b'back'\n");
}

/// `TCP_CORK` (nginx's `tcp_nopush`): the header written while corked and
/// the body sent with `sendfile` are held until the cork is taken out,
/// then read together.
#[test]
fn tcp_cork_holds_the_header_until_uncorked() {
    if !have_python() {
        return;
    }
    run("import tempfile\n\
        f=tempfile.TemporaryFile(); body=os.urandom(1024); f.write(body); f.flush()\n\
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)\n\
        assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)==1\n\
        head=b'HTTP/1.1 200 OK\\r\\nContent-Length: 1024\\r\\n\\r\\n'\n\
        assert os.writev(c.fileno(), [head[:10], head[10:]])==len(head)\n\
        assert os.sendfile(c.fileno(), f.fileno(), 0, 1024)==1024\n\
        assert select.select([s],[],[],0.05)[0]==[], 'corked data was sent'\n\
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)\n\
        assert s.recv(len(head)+1024, socket.MSG_WAITALL)==head+body\n\
        c.sendall(b'uncorked'); assert s.recv(8, socket.MSG_WAITALL)==b'uncorked'\n");
}

/// `MSG_MORE`: a send with it is held until a send without it, and both
/// are read together; the application's own `TCP_CORK` is not turned off
/// by it.
#[test]
fn msg_more_holds_until_a_send_without_it() {
    if !have_python() {
        return;
    }
    run("c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        assert c.send(b'head', socket.MSG_MORE)==4\n\
        assert select.select([s],[],[],0.05)[0]==[], 'MSG_MORE data was sent'\n\
        assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)==0\n\
        assert c.send(b'body')==4\n\
        assert s.recv(8, socket.MSG_WAITALL)==b'headbody'\n\
        assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)==0\n\
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)\n\
        c.send(b'x', socket.MSG_MORE); c.send(b'y')\n\
        assert select.select([s],[],[],0.05)[0]==[], 'the cork was taken out'\n\
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)\n\
        assert s.recv(2, socket.MSG_WAITALL)==b'xy'\n");
}

/// Header and body written separately with `TCP_NODELAY` (nginx with
/// `tcp_nopush off`: `writev`, then `sendfile`): once the connection's
/// bursts are known to be two sends, the header is held until the body
/// comes and both go as one message (another thread sees nothing
/// readable in between); the first burst, not yet known, is not held.
/// The hold limit is set far beyond the test, so only the body releases
/// the header here.
#[test]
fn autocork_sends_a_burst_of_small_writes_as_one_message() {
    if !have_python() {
        return;
    }
    run_with(
        "import tempfile\n\
        f=tempfile.TemporaryFile(); body=os.urandom(1024); f.write(body); f.flush()\n\
        head=b'HTTP/1.1 200 OK\\r\\nContent-Length: 1024\\r\\n\\r\\n'\n\
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        held=[]\n\
        def look(ev): held.append(select.select([s],[],[],0.05)[0]==[]); ev.set()\n\
        for i in range(4):\n    \
            assert c.send(head)==len(head)\n    \
            ev=threading.Event(); threading.Thread(target=look, args=(ev,)).start(); ev.wait()\n    \
            assert os.sendfile(c.fileno(), f.fileno(), 0, 1024)==1024\n    \
            select.select([],[c],[],5)\n    \
            assert s.recv(len(head)+1024, socket.MSG_WAITALL)==head+body\n\
        assert held==[False, True, True, True], held\n\
        assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)==0\n",
        &[("SOFTRDMA_SOCKETS_AUTOCORK", "100000")],
    );
}

/// A held write goes as soon as its thread makes another interposed call
/// (here a `select` on the same socket), without waiting for the hold
/// limit (set far beyond the test); and `SOFTRDMA_SOCKETS_AUTOCORK=0`
/// holds nothing.
#[test]
fn autocork_hold_ends_with_the_threads_next_call() {
    if !have_python() {
        return;
    }
    let learn = "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        c.send(b'h'); c.send(b'b'); select.select([],[c],[],5)\n\
        assert s.recv(2, socket.MSG_WAITALL)==b'hb'\n\
        def look(t, ev, out): out.append(select.select([s],[],[],t)[0]==[s]); ev.set()\n\
        def seen(t):\n    \
            out=[]; ev=threading.Event(); threading.Thread(target=look, args=(t, ev, out)).start(); ev.wait(); return out[0]\n\
        c.send(b'h')\n";
    run_with(
        &format!(
            "{learn}assert not seen(0.05), 'not held'\n\
            select.select([],[c],[],5)\n\
            assert seen(5), 'held after the next call'\n\
            assert s.recv(1)==b'h'\n"
        ),
        &[("SOFTRDMA_SOCKETS_AUTOCORK", "100000")],
    );
    run_with(
        &format!("{learn}assert seen(5), 'held with autocork off'\nassert s.recv(1)==b'h'\n"),
        &[("SOFTRDMA_SOCKETS_AUTOCORK", "0")],
    );
}

/// A thread that blocks outside the library right after a held write
/// (here on a `threading.Event`, a futex) does not keep it: the
/// library's flusher sends it after the hold limit (default).
#[test]
fn autocork_flusher_sends_a_write_held_by_a_thread_blocked_elsewhere() {
    if !have_python() {
        return;
    }
    run("c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        for i in range(3):\n    \
            c.send(b'h'); c.send(b'b'); select.select([],[c],[],5)\n    \
            assert s.recv(2, socket.MSG_WAITALL)==b'hb'\n\
        out=[]\n\
        def look(ev): out.append(select.select([s],[],[],30)[0]==[s]); ev.set()\n\
        c.send(b'h')\n\
        ev=threading.Event(); threading.Thread(target=look, args=(ev,)).start(); ev.wait()\n\
        assert out==[True], 'the held write never went'\n\
        assert s.recv(1)==b'h'\n");
}

/// Random bursts of small and large sends, with the burst's end now
/// a call, now a sleep outside the library, read by another thread:
/// every octet arrives once and in order.
#[test]
fn autocork_random_bursts_are_byte_exact() {
    if !have_python() {
        return;
    }
    run("import random\n\
        random.seed(5)\n\
        data=os.urandom(600_000); out=[]\n\
        def rx():\n    \
            b=bytearray()\n    \
            while len(b)<len(data): b+=s.recv(65536)\n    \
            out.append(bytes(b))\n\
        t=threading.Thread(target=rx); t.start()\n\
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        i=0\n\
        while i<len(data):\n    \
            for _ in range(random.choice([1,2,2,3,4])):\n        \
                n=min(random.choice([1,7,100,1000,4096,4097,9000]), len(data)-i)\n        \
                if n==0: break\n        \
                i+=c.send(data[i:i+n])\n    \
            r=random.random()\n    \
            if r<0.4: select.select([],[c],[],5)\n    \
            elif r<0.5: time.sleep(0.003)\n\
        t.join(); assert out[0]==data\n");
}

/// `writev` with many pieces (empty ones, one over 1 MiB in all) is
/// copied piece by piece into the stream: blocking, everything goes;
/// non-blocking, a prefix goes and the rest follows; byte-exact.
#[test]
fn writev_of_many_pieces_is_byte_exact() {
    if !have_python() {
        return;
    }
    run("data=os.urandom(1_500_000)\n\
        cuts=[0,1,1,7,300,301,70000,600000,600001,1_400_000,len(data)]\n\
        iov=[data[a:b] for a,b in zip(cuts,cuts[1:])]\n\
        out=[]\n\
        def rx():\n    \
            b=bytearray()\n    \
            while len(b)<2*len(data): b+=s.recv(1<<20)\n    \
            out.append(bytes(b))\n\
        t=threading.Thread(target=rx); t.start()\n\
        assert os.writev(c.fileno(), iov)==len(data)\n\
        c.setblocking(False); n=0\n\
        while n<len(data):\n    \
            rest=[]; at=0\n    \
            for p in iov:\n        \
                if at+len(p)>n: rest.append(p[max(0,n-at):])\n        \
                at+=len(p)\n    \
            try: n+=os.writev(c.fileno(), rest)\n    \
            except BlockingIOError: select.select([],[c],[],5)\n\
        t.join(); assert out[0]==data+data\n");
}

/// `TCP_NODELAY` on a switched connection is the stream's: `getsockopt`
/// reads what the application set (0 if it never did), not the kernel
/// socket's, which the engine keeps on for its own messages (before,
/// it read 1 after the switch, and a 0 set by the application turned
/// Nagle on for the engine's messages).
#[test]
fn tcp_nodelay_is_the_streams_after_the_switch() {
    if !have_python() {
        return;
    }
    run("T=(socket.IPPROTO_TCP, socket.TCP_NODELAY)\n\
        assert c.getsockopt(*T)==0 and s.getsockopt(*T)==0, (c.getsockopt(*T), s.getsockopt(*T))\n\
        c.setsockopt(*T, 1); assert c.getsockopt(*T)==1\n\
        c.sendall(b'a'); assert s.recv(1)==b'a'\n\
        c.setsockopt(*T, 0); assert c.getsockopt(*T)==0\n\
        c.sendall(b'b'*5000); assert s.recv(5000, socket.MSG_WAITALL)==b'b'*5000\n\
        try:\n    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, b'\\x01'); raise SystemExit('short value accepted')\n\
        except OSError as e: assert e.errno==errno.EINVAL, e\n");
}

/// A server whose first call on an accepted socket sets `TCP_NODELAY`
/// (redis, nginx) switches the connection in that call: the switch takes
/// the application's setting from the call (no `getsockopt`), so the
/// stream's view is the value set, on or off, and both connections are
/// offloaded and carry data both ways.
#[test]
fn tcp_nodelay_set_by_the_first_call_of_an_accepted_socket_is_the_streams() {
    if !have_python() {
        return;
    }
    let script = "import socket,threading\n\
        T=(socket.IPPROTO_TCP, socket.TCP_NODELAY)\n\
        l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(8)\n\
        for on in (1, 0):\n    \
            r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',l.getsockname()[1])))); t.start()\n    \
            s,_=l.accept(); s.setsockopt(*T, on); t.join(); c=r[0]\n    \
            assert s.getsockopt(*T)==on, (on, s.getsockopt(*T))\n    \
            c.sendall(b'q'*3000); assert s.recv(3000, socket.MSG_WAITALL)==b'q'*3000\n    \
            s.sendall(b'a'); assert c.recv(1)==b'a'\n    \
            s.setsockopt(*T, 1-on); assert s.getsockopt(*T)==1-on\n    \
            c.close(); assert s.recv(1)==b''; s.close()\n\
        print('DONE')\n";
    let lines = python_done(script, &[("SOFTRDMA_SOCKETS", "auto")]);
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

#[test]
fn fork_after_accept_child_serves_and_fork_for_work_parent_keeps_it() {
    if !have_python() {
        return;
    }
    // Fork after accept: a forking server whose parent only accepts (the
    // client is another preloaded process); the child switches and serves
    // the connection on its first use, the parent closes its descriptor.
    let script = "import socket,os,sys,subprocess\n\
        l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(8)\n\
        code='import socket,sys\\nc=socket.create_connection((\"127.0.0.1\",int(sys.argv[1])))\\nc.sendall(b\"abcd\")\\nassert c.recv(4, socket.MSG_WAITALL)==b\"dcba\"\\nprint(\"CLIENT OK\")'\n\
        cl=subprocess.Popen([sys.executable,'-c',code,str(l.getsockname()[1])], stdout=subprocess.PIPE, text=True)\n\
        s,_=l.accept()\n\
        pid=os.fork()\n\
        if pid==0:\n    x=s.recv(4, socket.MSG_WAITALL); s.sendall(x[::-1]); s.close(); os._exit(0)\n\
        s.close()\n\
        assert cl.communicate()[0].strip()=='CLIENT OK'\n\
        assert os.waitpid(pid,0)[1]==0\n\
        print('DONE')\n";
    let lines = python_done(script, &[("SOFTRDMA_SOCKETS", "auto")]);
    // The client process (offloaded: the child switched the server end)
    // and the parent (0: it only accepted); the child leaves with _exit
    // (no stats line).
    let mut offloaded: Vec<String> = lines.iter().map(|l| field(l, "offloaded")).collect();
    offloaded.sort();
    assert_eq!(offloaded, ["0", "1"], "{lines:?}");

    // Fork for work: the parent keeps the connection, the child never
    // uses it (it only closes its copy).
    run("c.sendall(b'1'); assert s.recv(1)==b'1'\n\
        pid=os.fork()\n\
        if pid==0:\n    s.close(); c.close(); os._exit(0)\n\
        assert os.waitpid(pid,0)[1]==0\n\
        c.sendall(b'after fork'); assert s.recv(10, socket.MSG_WAITALL)==b'after fork'\n\
        s.sendall(b'ok'); assert c.recv(2, socket.MSG_WAITALL)==b'ok'\n");
}

/// A close returns before the peer's FIN in a process that exits with its
/// exit handlers (they wait for it); a forked child often ends with
/// `_exit(2)` instead (a server forking per connection), so there the
/// close still waits for the peer's FIN in the call: here the peer is
/// stopped for 1.5 s, and the child's close takes that long (400 ms at
/// least is asserted: scheduling delays do not fail it). The child
/// forked before any connection of its own (the fork is counted from the
/// library's load).
#[test]
fn a_forked_childs_close_waits_for_the_peers_fin() {
    if !have_python() {
        return;
    }
    let script = "import socket,os,sys,subprocess,signal,time\n\
        code='import socket\\nl=socket.socket(); l.bind((\"127.0.0.1\",0)); l.listen(4)\\nprint(l.getsockname()[1], flush=True)\\ns,_=l.accept(); s.settimeout(20)\\nx=s.recv(4, socket.MSG_WAITALL)\\nprint(\"read\", len(x), flush=True)\\nprint(\"eof\", s.recv(10)==b\"\", flush=True)'\n\
        p=subprocess.Popen([sys.executable,'-c',code], stdout=subprocess.PIPE, text=True)\n\
        port=int(p.stdout.readline())\n\
        r1,w1=os.pipe(); r2,w2=os.pipe()\n\
        pid=os.fork()\n\
        if pid==0:\n    c=socket.create_connection(('127.0.0.1',port)); c.sendall(b'abcd')\n    os.write(w1, b'sent'); os.read(r2, 2)\n    t=time.monotonic(); c.close(); os.write(w1, str(int((time.monotonic()-t)*1000)).encode()); os._exit(0)\n\
        assert os.read(r1, 4)==b'sent'\n\
        assert p.stdout.readline().split()==['read','4']\n\
        os.kill(p.pid, signal.SIGSTOP)\n\
        os.write(w2, b'go'); time.sleep(1.5); os.kill(p.pid, signal.SIGCONT)\n\
        ms=int(os.read(r1, 16))\n\
        assert ms>=400, ms\n\
        assert p.stdout.readline().split()==['eof','True']\n\
        assert os.waitpid(pid,0)[1]==0 and p.wait(10)==0\n\
        print('DONE')\n";
    let lines = python_done(script, &[("SOFTRDMA_SOCKETS", "auto")]);
    // The peer's line (its connection offloaded); the child leaves with
    // _exit and the parent made no connection: no line of theirs.
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(field(&lines[0], "offloaded"), "1", "{lines:?}");
}

/// Regression: `SO_LINGER` on with a zero time, then `close`: the peer
/// read the data and EOF (the close sent the DisConn and FIN), where with
/// the kernel's TCP it gets `ECONNRESET`. The close now resets the
/// connection (AbortConn, RST), as the kernel's abortive close does.
#[test]
fn a_close_with_so_linger_zero_gave_the_peer_eof_instead_of_a_reset() {
    if !have_python() {
        return;
    }
    let lines = run("c.sendall(b'dropped'); time.sleep(0.1)\n\
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0)); c.close()\n\
        s.settimeout(20); err=None\n\
        try:\n    while s.recv(100): pass\n\
        except ConnectionResetError as x: err=x\n\
        assert err is not None, 'EOF, not a reset'\n");
    assert_eq!(field(&lines[0], "offloaded"), "2", "{lines:?}");
}

#[test]
fn blocking_calls_return_eintr_and_sigpipe_is_raised_unless_suppressed() {
    if !have_python() {
        return;
    }
    run("class Alarm(Exception): pass\n\
        def on_alarm(n, f): raise Alarm()\n\
        signal.signal(signal.SIGALRM, on_alarm)\n\
        signal.setitimer(signal.ITIMER_REAL, 0.3)\n\
        try:\n    s.recv(10); raise SystemExit('recv returned')\n\
        except Alarm: pass\n\
        c.sendall(b'z'); assert s.recv(1)==b'z', 'usable after EINTR'\n\
        pipes=[]\n\
        signal.signal(signal.SIGPIPE, lambda n,f: pipes.append(n))\n\
        s.close(); time.sleep(0.3)\n\
        err=None\n\
        for i in range(50):\n\
        \x20   try:\n\
        \x20       c.send(b'x'*1000, socket.MSG_NOSIGNAL)\n\
        \x20   except OSError as x:\n\
        \x20       err=x; break\n\
        \x20   time.sleep(0.02)\n\
        assert err is not None and pipes==[], (err, pipes)\n\
        try:\n    c.send(b'x')\n\
        except OSError as x: assert x.errno==errno.EPIPE, x\n\
        time.sleep(0.05); assert pipes==[signal.SIGPIPE], pipes\n");
}

/// poll, select and epoll_wait sleep in the engine: a signal whose
/// handler raises ends them (`EINTR`, not restarted), and data sent by
/// another thread while they sleep wakes them.
#[test]
fn engine_waits_return_eintr_and_wake_on_data_from_another_thread() {
    if !have_python() {
        return;
    }
    run("class Alarm(Exception): pass\n\
        def on_alarm(*a): raise Alarm()\n\
        signal.signal(signal.SIGALRM, on_alarm)\n\
        e=select.epoll(); e.register(s.fileno(), select.EPOLLIN)\n\
        p=select.poll(); p.register(s, select.POLLIN)\n\
        for name,f in [('epoll',lambda: e.poll(30)),('poll',lambda: p.poll(30000)),('select',lambda: select.select([s],[],[],30))]:\n\
        \x20   signal.setitimer(signal.ITIMER_REAL, 0.2)\n\
        \x20   try:\n\
        \x20       r=f(); raise SystemExit(name+' not interrupted: '+repr(r))\n\
        \x20   except Alarm: pass\n\
        threading.Timer(0.2, lambda: c.sendall(b'w')).start()\n\
        assert e.poll(30)==[(s.fileno(), select.EPOLLIN)]\n\
        assert s.recv(1)==b'w'\n\
        threading.Timer(0.2, lambda: c.sendall(b'v')).start()\n\
        assert p.poll(30000)==[(s.fileno(), select.POLLIN)]\n\
        assert s.recv(1)==b'v'\n\
        threading.Timer(0.2, lambda: c.sendall(b'u')).start()\n\
        r,_,_=select.select([s],[],[],30); assert r==[s]\n\
        assert s.recv(1)==b'u'\n");
}

/// Regression (nginx served one request per connection, then hung): an
/// edge-triggered reader that stops at a short read, without waiting for
/// `EAGAIN`, as nginx does with `EPOLLRDHUP`, is told of the next message
/// (every arrival is an edge); one that stopped in the middle of the data
/// is not told again without one. Writable and the end of the stream
/// (`EPOLLRDHUP`) come with their edges.
#[test]
fn edge_triggered_reports_every_arrival_to_a_reader_that_stops_at_a_short_read() {
    if !have_python() {
        return;
    }
    run("s.setblocking(False)\n\
        IN,OUT,ET,RD=select.EPOLLIN,select.EPOLLOUT,select.EPOLLET,select.EPOLLRDHUP\n\
        e=select.epoll(); e.register(s.fileno(), IN|OUT|ET|RD)\n\
        assert e.poll(2)==[(s.fileno(), OUT)], 'writable at first'\n\
        assert e.poll(0.1)==[], 'no new edge'\n\
        for i in range(3):\n\
        \x20   q=b'GET /%d' % i; c.sendall(q)\n\
        \x20   ev=e.poll(2); assert ev and ev[0][1] & IN, (i, ev)\n\
        \x20   assert s.recv(4096)==q, 'a short read, no EAGAIN'\n\
        \x20   s.sendall(b'ok'); assert c.recv(2)==b'ok'\n\
        c.sendall(b'0123456789')\n\
        assert e.poll(2)[0][1] & IN\n\
        assert s.recv(5)==b'01234'\n\
        assert e.poll(0.2)==[], 'stopped in the middle: no new edge'\n\
        assert s.recv(100)==b'56789'\n\
        c.shutdown(socket.SHUT_WR)\n\
        ev=e.poll(2); assert ev and ev[0][1] & IN and ev[0][1] & RD, ev\n\
        assert s.recv(10)==b''\n");
}

/// A registration changed by another thread while a wait sleeps on it
/// (level-triggered made one-shot) is reported by its new rules: once,
/// then silent though its data stays unread (a wait that reported it by
/// the rules it saw when it went to sleep would report it again and
/// again).
#[test]
fn a_registration_made_one_shot_during_a_wait_is_reported_once() {
    if !have_python() {
        return;
    }
    run("s.setblocking(False)\n\
        e=select.epoll(); e.register(s.fileno(), select.EPOLLIN)\n\
        def later(): time.sleep(0.3); e.modify(s.fileno(), select.EPOLLIN|select.EPOLLONESHOT); c.sendall(b'x')\n\
        t=threading.Thread(target=later); t.start()\n\
        ev=e.poll(5); t.join(); assert ev==[(s.fileno(), select.EPOLLIN)], ev\n\
        assert e.poll(0.2)==[], 'one-shot: reported once'\n\
        e.modify(s.fileno(), select.EPOLLIN)\n\
        assert e.poll(2)==[(s.fileno(), select.EPOLLIN)], 'level-triggered again'\n\
        assert e.poll(2)==[(s.fileno(), select.EPOLLIN)], 'and again while unread'\n\
        assert s.recv(10)==b'x'\n");
}

/// An epoll instance with an offloaded connection and a plain descriptor
/// (a pipe), both ready, waited on one event at a time: they take turns
/// (neither starves the other).
#[test]
fn epoll_with_one_event_at_a_time_alternates_offloaded_and_kernel_descriptors() {
    if !have_python() {
        return;
    }
    run("r,w=os.pipe()\n\
        e=select.epoll(); e.register(r, select.EPOLLIN); e.register(s.fileno(), select.EPOLLIN)\n\
        os.write(w, b'p'); c.sendall(b'x')\n\
        select.select([s],[],[],5)\n\
        got=[e.poll(2, 1) for _ in range(4)]\n\
        fds=[g[0][0] for g in got if g]\n\
        assert set(fds)=={r, s.fileno()}, got\n\
        assert s.recv(1)==b'x' and os.read(r, 1)==b'p'\n");
}

/// An epoll instance holding an offloaded connection, added to another
/// epoll instance (nested): the outer one reports the inner one when data
/// comes, and the inner one reports the connection.
#[test]
fn an_epoll_instance_nested_in_another_reports_offloaded_data() {
    if !have_python() {
        return;
    }
    run(
        "inner=select.epoll(); inner.register(s.fileno(), select.EPOLLIN)\n\
        outer=select.epoll(); outer.register(inner.fileno(), select.EPOLLIN)\n\
        assert outer.poll(0.1)==[], 'nothing yet'\n\
        c.sendall(b'n')\n\
        assert outer.poll(5)==[(inner.fileno(), select.EPOLLIN)]\n\
        assert inner.poll(0)==[(s.fileno(), select.EPOLLIN)]\n\
        assert s.recv(1)==b'n'\n\
        inner.unregister(s.fileno()); inner.register(s.fileno(), select.EPOLLIN)\n\
        c.sendall(b'm')\n\
        assert outer.poll(5)==[(inner.fileno(), select.EPOLLIN)]\n\
        assert s.recv(1)==b'm'\n",
    );
}

#[test]
fn an_exec_never_inherits_an_offloaded_stream() {
    if !have_python() {
        return;
    }
    // The new program finds the descriptor closed (EBADF), never the RDMA
    // framing as data; the peer's connection ends.
    run("import subprocess\n\
        assert not os.get_inheritable(s.fileno())\n\
        os.set_inheritable(s.fileno(), True); assert os.get_inheritable(s.fileno())\n\
        code='import os,sys\\ntry:\\n    os.read(int(sys.argv[1]),1); print(\"READ\")\\nexcept OSError as e: print(e.errno)'\n\
        out=subprocess.run([sys.executable,'-c',code,str(s.fileno())], pass_fds=[s.fileno()], capture_output=True, text=True).stdout.strip()\n\
        assert out==str(errno.EBADF), out\n\
        c.sendall(b'parent still works'); assert s.recv(18, socket.MSG_WAITALL)==b'parent still works'\n");
}

#[test]
fn a_failed_switch_reconnects_plain_before_any_byte() {
    if !have_python() {
        return;
    }
    // The listener (and its twin) exist before this process starts its
    // engine (the offloaded pair of the prelude); a child forked after
    // that cannot switch: the connection it accepts fails at its first
    // use, and the client, still inside connect, makes a plain one in its
    // place, which carries the bytes.
    let script = "import socket,os,sys,subprocess,select,threading\n\
        l2=socket.socket(); l2.bind(('127.0.0.1',0)); l2.listen(8)\n\
        l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(8)\n\
        r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',l.getsockname()[1])))); t.start()\n\
        s,_=l.accept(); select.select([],[s],[],5); t.join(); r[0].sendall(b'p'); assert s.recv(1)==b'p'\n\
        pid=os.fork()\n\
        if pid==0:\n\
        \x20   a,_=l2.accept()\n\
        \x20   try:\n\
        \x20       a.recv(1); os._exit(3)\n\
        \x20   except ConnectionResetError: a.close()\n\
        \x20   b,_=l2.accept(); x=b.recv(5, socket.MSG_WAITALL); b.sendall(x.upper()); b.close(); os._exit(0)\n\
        code='import socket,sys\\nc=socket.create_connection((\"127.0.0.1\",int(sys.argv[1])))\\nc.sendall(b\"plain\")\\nassert c.recv(5, socket.MSG_WAITALL)==b\"PLAIN\"\\nprint(\"CLIENT OK\")'\n\
        out=subprocess.run([sys.executable,'-c',code,str(l2.getsockname()[1])], capture_output=True, text=True, timeout=30).stdout.strip()\n\
        assert out=='CLIENT OK', out\n\
        assert os.waitpid(pid,0)[1]==0\n\
        print('DONE')\n";
    let lines = python_done(script, &[("SOFTRDMA_SOCKETS", "auto")]);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("\"offload setup failed\":1")),
        "the client counted the failed switch: {lines:?}"
    );
}

#[test]
fn close_range_forgets_offloaded_descriptors_whose_numbers_are_reused() {
    if !have_python() {
        return;
    }
    run("c.sendall(b'x'); assert s.recv(1)==b'x'\n\
        fd=s.fileno(); s.detach(); os.closerange(fd, fd+1)\n\
        u=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('127.0.0.1',0))\n\
        v=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); v.sendto(b'plain', u.getsockname())\n\
        assert u.fileno()==fd and u.recv(10)==b'plain'\n");
}

/// An epoll instance holding an offloaded connection closed by
/// `close_range`: a new instance that gets its number starts empty.
#[test]
fn close_range_forgets_epoll_instances_whose_numbers_are_reused() {
    if !have_python() {
        return;
    }
    run(
        "e=select.epoll(); efd=e.fileno(); e.register(s.fileno(), select.EPOLLIN)\n\
        c.sendall(b'q'); assert e.poll(5)==[(s.fileno(), select.EPOLLIN)]\n\
        os.closerange(efd, efd+1)\n\
        e2=select.epoll(); assert e2.fileno()==efd\n\
        assert e2.poll(0.2)==[], 'the closed instance registrations'\n\
        e2.close(); del e\n\
        assert s.recv(1)==b'q'\n",
    );
}

#[test]
fn the_librarys_threads_block_every_signal() {
    if !have_python() {
        return;
    }
    // Twin and engine threads (started by the listener and the switch)
    // never run the application's signal handlers. The connecting Python
    // thread is joined, but its task can still be listed for a moment
    // after `join` returns: wait (up to 1 s) until no other task has the
    // main thread's name. A task that ends while it is looked at (its
    // files gone) runs no handler: it is skipped.
    run("import glob\n\
        c.sendall(b'x'); assert s.recv(1)==b'x'\n\
        tasks=lambda: [t for t in glob.glob('/proc/self/task/*') if int(t.split('/')[-1])!=os.getpid()]\n\
        def read(t,f):\n\
        \x20   try:\n\
        \x20       return open(t+'/'+f).read()\n\
        \x20   except (FileNotFoundError, ProcessLookupError):\n\
        \x20       return None\n\
        main=open('/proc/self/comm').read().strip()\n\
        for _ in range(100):\n\
        \x20   if all((read(t,'comm') or '').strip()!=main for t in tasks()): break\n\
        \x20   time.sleep(0.01)\n\
        others=tasks()\n\
        assert others, 'the library started threads'\n\
        for t in others:\n\
        \x20   st,name=read(t,'status'),read(t,'comm')\n\
        \x20   if st is None or name is None: continue\n\
        \x20   blk=int([l for l in st.splitlines() if l.startswith('SigBlk:')][0].split()[1],16)\n\
        \x20   assert all(blk>>(n-1)&1 for n in range(1,32) if n not in (9,19)), (name.strip(), hex(blk))\n");
}

#[test]
fn sendmmsg_and_recvmmsg_go_through_the_offloaded_stream() {
    if !have_python() {
        return;
    }
    run("import ctypes\n\
        class IOV(ctypes.Structure): _fields_=[('base',ctypes.c_void_p),('len',ctypes.c_size_t)]\n\
        class MH(ctypes.Structure): _fields_=[('name',ctypes.c_void_p),('namelen',ctypes.c_uint32),('iov',ctypes.POINTER(IOV)),('iovlen',ctypes.c_size_t),('control',ctypes.c_void_p),('controllen',ctypes.c_size_t),('flags',ctypes.c_int)]\n\
        class MMH(ctypes.Structure): _fields_=[('hdr',MH),('len',ctypes.c_uint)]\n\
        libc=ctypes.CDLL(None, use_errno=True)\n\
        bufs=[ctypes.create_string_buffer(b'first'), ctypes.create_string_buffer(b'second')]\n\
        iovs=[IOV(ctypes.cast(b,ctypes.c_void_p), len(b.value)) for b in bufs]\n\
        msgs=(MMH*2)(); msgs[0].hdr.iov=ctypes.pointer(iovs[0]); msgs[0].hdr.iovlen=1; msgs[1].hdr.iov=ctypes.pointer(iovs[1]); msgs[1].hdr.iovlen=1\n\
        assert libc.sendmmsg(c.fileno(), msgs, 2, 0)==2 and msgs[1].len==6\n\
        assert s.recv(11, socket.MSG_WAITALL)==b'firstsecond'\n\
        c.sendall(b'abc')\n\
        rb=ctypes.create_string_buffer(16); riov=IOV(ctypes.cast(rb,ctypes.c_void_p), 16)\n\
        r=(MMH*1)(); r[0].hdr.iov=ctypes.pointer(riov); r[0].hdr.iovlen=1\n\
        assert libc.recvmmsg(s.fileno(), r, 1, 0, None)==1 and rb.raw[:r[0].len]==b'abc', r[0].len\n");
}

/// A client's socket is bound, for its capability query, to a port chosen
/// at random in the ephemeral range (one look-up in the kernel), not by a
/// `bind` to port 0 (which searches the range, `TIME_WAIT` included, and
/// gives odd ports first: 16 connections from port-0 binds would all have
/// odd ports). `SO_REUSEADDR`, set for that bind only if the port was in
/// use, reads as the application left it; a port the application bound
/// itself is kept.
#[test]
fn a_client_asks_from_a_chosen_ephemeral_port_and_keeps_its_options() {
    if !have_python() {
        return;
    }
    let lines = run(
        "lo,hi=map(int,open('/proc/sys/net/ipv4/ip_local_port_range').read().split())\n\
        c.close(); s.close()\n\
        ports=[]\n\
        for i in range(16):\n    c,s=connect()\n    p=c.getsockname()[1]; assert lo<=p<=hi, (p,lo,hi)\n    assert c.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)==0\n    c.sendall(b'x'); assert s.recv(1)==b'x'\n    ports.append(p); c.close(); s.close()\n\
        assert any(p%2==0 for p in ports), ports\n\
        port=l.getsockname()[1]\n\
        def own():\n    x=socket.socket(); x.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); x.bind(('127.0.0.1',0)); b=x.getsockname()[1]; x.connect(('127.0.0.1',port)); r.append((x,b))\n\
        r=[]; t=threading.Thread(target=own); t.start()\n\
        s,_=l.accept(); select.select([],[s],[],5); t.join(); x,b=r[0]\n\
        assert x.getsockname()[1]==b and x.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)!=0\n\
        x.sendall(b'y'); assert s.recv(1)==b'y'\n",
    );
    assert_eq!(field(&lines[0], "offloaded"), "36", "{lines:?}");
}

/// A listener's twin starts before its port listens when the socket is
/// bound (a client connecting in between found no twin and went plain),
/// and after `listen` when `listen` binds the port itself; a `listen` that
/// fails keeps its errno.
#[test]
fn a_listener_bound_by_listen_itself_gets_its_twin_and_a_failed_listen_its_errno() {
    if !have_python() {
        return;
    }
    let lines = run(
        "u=socket.socket(); u.listen(8); up=u.getsockname()[1]; assert up!=0\n\
        r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',up)))); t.start()\n\
        s2,_=u.accept(); select.select([],[s2],[],5); t.join(); c2=r[0]\n\
        c2.sendall(b'z'); assert s2.recv(1)==b'z'\n\
        try:\n    c2.listen(1); assert False, 'listen on a connected socket'\n\
        except OSError as e:\n    assert e.errno==errno.EINVAL, e\n",
    );
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// Regression: of listeners sharing a port by `SO_REUSEPORT` (nginx's
/// `reuseport`: one per worker) only the first got a twin (the port's UDP
/// twin was bound already): a client that asked it was switched, but its
/// connection, spread by the kernel to another listener, was accepted
/// plain, and the application read the switch's MPA request as data.
#[test]
fn a_second_reuseport_listener_had_no_twin_and_read_the_switch_as_data() {
    if !have_python() {
        return;
    }
    let lines = run("ls=[]\n\
        for i in range(2):\n    x=socket.socket(); x.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEPORT,1)\n    x.bind(('127.0.0.1',ls[0].getsockname()[1] if ls else 0)); x.listen(16); ls.append(x)\n\
        got=[0,0]\n\
        for i in range(16):\n    r=[]\n    def cl():\n        k=socket.create_connection(('127.0.0.1',ls[0].getsockname()[1])); k.sendall(b'ping'); r.append(k.recv(4)); k.close()\n    t=threading.Thread(target=cl,daemon=True); t.start()\n    rd,_,_=select.select(ls,[],[],5); assert rd\n    a,_=rd[0].accept(); got[ls.index(rd[0])]+=1; a.settimeout(5)\n    d=a.recv(4); assert d==b'ping', (ls.index(rd[0]), d)\n    a.sendall(b'pong'); t.join(5); assert r==[b'pong'], r; a.close()\n\
        assert min(got)>0, got\n");
    assert_eq!(field(&lines[0], "offloaded"), "34", "{lines:?}");
    assert_eq!(field(&lines[0], "plain"), "0", "{lines:?}");
}

/// Regression: a duplicate of a listening descriptor (`dup`, `dup2`,
/// `fcntl(F_DUPFD)`, Python's `socket.dup`/`fromfd`) had no twin: a
/// client that asked the listener's twin was switched, but the connection
/// accepted on the duplicate stayed plain, and the application read the
/// switch's MPA request as data. A descriptor replaced by `dup2` is no
/// longer the listener it was.
#[test]
fn a_duplicated_listener_had_no_twin_and_read_the_switch_as_data() {
    if !have_python() {
        return;
    }
    let lines = run(
        "l2=l.dup(); l3=socket.socket(); os.dup2(l.fileno(), l3.fileno())\n\
        for x in [l2, l3, l2, l3]:\n    r=[]\n    def cl():\n        k=socket.create_connection(('127.0.0.1',l.getsockname()[1])); k.sendall(b'ping'); r.append(k.recv(4)); k.close()\n    t=threading.Thread(target=cl,daemon=True); t.start()\n    a,_=x.accept(); a.settimeout(5)\n    d=a.recv(4); assert d==b'ping', d\n    a.sendall(b'pong'); t.join(5); assert r==[b'pong'], r; a.close()\n\
        u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); os.dup2(u.fileno(), l2.fileno())\n\
        x=socket.socket(fileno=os.dup(l3.fileno())); l.close(); l3.close()\n\
        r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',x.getsockname()[1]))),daemon=True); t.start()\n\
        a,_=x.accept(); select.select([],[a],[],5); t.join(5); r[0].sendall(b'z'); assert a.recv(1)==b'z'\n",
    );
    assert_eq!(field(&lines[0], "offloaded"), "12", "{lines:?}");
    assert_eq!(field(&lines[0], "plain"), "0", "{lines:?}");
}

/// Regression: every listener's twin mapped 516 KiB of shared memory for
/// its records and never unmapped it, nor the one of a twin that could
/// not start: a process that opened listeners one after another (a
/// passive-mode FTP server, a test harness) kept a mapping per listener
/// ever opened, up to the kernel's limit on mappings (65530), past which
/// every `mmap` of the process fails.
#[test]
fn a_closed_listeners_twin_records_stayed_mapped() {
    if !have_python() {
        return;
    }
    let lines = run(
        "def recs():\n    n=0\n    for m in open('/proc/self/maps'):\n        a,b=m.split()[0].split('-')\n        n+=int(b,16)-int(a,16)==(16384*32+4096)\n    return n\n\
        n0=recs()\n\
        for i in range(200):\n    x=socket.socket(); x.bind(('127.0.0.1',0)); x.listen(1); x.close()\n\
        for i in range(50):\n    x,=free_port((socket.AF_INET,'127.0.0.1',None)); y=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); y.bind(x.getsockname()); x.listen(1); x.close(); y.close()\n\
        end=time.time()+10\n\
        while recs()>n0+2 and time.time()<end: time.sleep(0.05)\n\
        assert recs()<=n0+2, (n0, recs())\n",
    );
    assert_eq!(field(&lines[0], "offloaded"), "2", "{lines:?}");
}

/// Regression: the twin of an IPv6 listener with `IPV6_V6ONLY` (nginx's
/// `listen [::]:80`, before its `listen 80`) took the port for IPv4
/// queries as well: the IPv4 listener of the port got no twin, its
/// clients asked the IPv6 one and switched, and the connection accepted
/// plain read the switch's MPA request as data.
#[test]
fn a_v6only_listeners_twin_answered_for_the_v4_listener_of_its_port() {
    if !have_python() || std::net::TcpListener::bind("[::1]:0").is_err() {
        return;
    }
    let lines = run(
        "x6,x4=free_port((socket.AF_INET6,'::',1),(socket.AF_INET,'0.0.0.0',None)); P=x6.getsockname()[1]; x6.listen(8); x4.listen(8)\n\
        for x,host in [(x4,'127.0.0.1'),(x6,'::1')]:\n    r=[]\n    def cl():\n        k=socket.create_connection((host,P)); k.sendall(b'ping'); r.append(k.recv(4)); k.close()\n    t=threading.Thread(target=cl,daemon=True); t.start()\n    a,_=x.accept(); a.settimeout(5)\n    d=a.recv(4); assert d==b'ping', (host, d)\n    a.sendall(b'pong'); t.join(5); assert r==[b'pong'], r; a.close()\n",
    );
    assert_eq!(field(&lines[0], "offloaded"), "6", "{lines:?}");
    assert_eq!(field(&lines[0], "plain"), "0", "{lines:?}");
}

/// Regression: `setsockopt(TCP_NODELAY)` and `SO_RCVTIMEO` on a
/// connection read the caller's value as an aligned `int` / `timeval`: a
/// value at an odd address (legal in C) was undefined behaviour, and a
/// build with debug assertions aborted the process.
#[test]
fn an_unaligned_option_value_aborted_the_process() {
    if !have_python() {
        return;
    }
    let lines = run("import ctypes\n\
        libc=ctypes.CDLL(None, use_errno=True)\n\
        b=ctypes.create_string_buffer(64); at=ctypes.addressof(b)+1\n\
        ctypes.memmove(at, struct.pack('i',1), 4)\n\
        assert libc.setsockopt(s.fileno(), socket.IPPROTO_TCP, socket.TCP_NODELAY, ctypes.c_void_p(at), 4)==0\n\
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)!=0\n\
        ctypes.memmove(at, struct.pack('ll',0,300000), 16)\n\
        assert libc.setsockopt(s.fileno(), socket.SOL_SOCKET, socket.SO_RCVTIMEO, ctypes.c_void_p(at), 16)==0\n\
        t0=time.time()\n\
        try:\n    s.recv(1); assert False\n\
        except OSError as e:\n    assert e.errno in (errno.EAGAIN, errno.EWOULDBLOCK), e\n\
        assert 0.2 < time.time()-t0 < 3, time.time()-t0\n\
        r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',l.getsockname()[1]))),daemon=True); t.start()\n\
        s2,_=l.accept(); ctypes.memmove(at, struct.pack('i',1), 4)\n\
        assert libc.setsockopt(s2.fileno(), socket.IPPROTO_TCP, socket.TCP_NODELAY, ctypes.c_void_p(at), 4)==0\n\
        t.join(5); r[0].sendall(b'z'); assert s2.recv(1)==b'z'\n");
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// A non-blocking `connect` is waited for and switched once the
/// connection is up (writable without an error), and still returns
/// `EINPROGRESS`; one to a port nobody listens on is left to the
/// application, which reads the refusal from `SO_ERROR` (not consumed).
#[test]
fn a_non_blocking_connect_is_switched_once_up_and_a_refused_one_keeps_its_error() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        port=l.getsockname()[1]\n\
        r=[]\n\
        def nb():\n    x=socket.socket(); x.setblocking(False); r.append(x.connect_ex(('127.0.0.1',port))); r.append(x)\n\
        t=threading.Thread(target=nb); t.start()\n\
        s,_=l.accept(); select.select([],[s],[],5); t.join()\n\
        assert r[0]==errno.EINPROGRESS, r\n\
        x=r[1]; select.select([],[x],[],5)\n\
        assert x.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)==0\n\
        x.setblocking(True); x.sendall(b'nb'); assert s.recv(2)==b'nb'\n\
        d=socket.socket(); d.bind(('127.0.0.1',0)); dead=d.getsockname()[1]; d.close()\n\
        y=socket.socket(); y.setblocking(False); e=y.connect_ex(('127.0.0.1',dead))\n\
        assert e in (errno.EINPROGRESS, errno.ECONNREFUSED), e\n\
        select.select([],[y],[],5)\n\
        assert y.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)==errno.ECONNREFUSED\n");
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// A sockets-direct client (`softrdma_sockets`) connecting to a preloaded
/// listener learns from the twin's first answer that it decides late
/// queries, and sends its next queries beside the SYN: those connections
/// are switched on both ends too (the accept answers the query queued
/// before the connection, then finds its record).
#[test]
fn a_sockets_client_sends_its_next_queries_beside_the_syn() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port_file = dir.path().join("port");
    let pf = port_file.to_str().unwrap().to_string();
    let server = std::thread::spawn(move || {
        python(
            "import socket,os\n\
             l=socket.socket(); l.bind(('127.0.0.1',0)); l.listen(8)\n\
             open(os.environ['PORT_FILE']+'.tmp','w').write(str(l.getsockname()[1]))\n\
             os.rename(os.environ['PORT_FILE']+'.tmp', os.environ['PORT_FILE'])\n\
             for i in range(3):\n    s,_=l.accept(); d=s.recv(100); s.sendall(d[::-1]); s.recv(1); s.close()\n\
             print('DONE')\n",
            &[("SOFTRDMA_SOCKETS", "auto"), ("PORT_FILE", &pf)],
        )
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let port: u16 = loop {
        if let Ok(p) = std::fs::read_to_string(&port_file) {
            break p.trim().parse().unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "no listener");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    for i in 0..3u8 {
        use std::io::{Read, Write};
        let mut c = softrdma_sockets::TcpStream::connect(("127.0.0.1", port)).unwrap();
        assert!(
            c.transport().is_offloaded(),
            "connection {i}: {:?}",
            c.transport()
        );
        c.write_all(&[b'a', b'b', b'0' + i]).unwrap();
        let mut b = [0u8; 3];
        c.read_exact(&mut b).unwrap();
        assert_eq!(b, [b'0' + i, b'b', b'a']);
    }
    let (out, lines) = server.join().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("DONE"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(field(&lines[0], "offloaded"), "3", "{lines:?}");
}

/// Copies through user space share one buffer per thread from call to
/// call: after a large `sendfile` and `writev` filled it, a short `readv`
/// over two vectors gets exactly the bytes that came (none of what the
/// buffer held before), and a `writev` sends exactly its vectors.
#[test]
fn copies_through_user_space_never_show_an_earlier_calls_bytes() {
    if !have_python() {
        return;
    }
    run("import tempfile\n\
        f=tempfile.TemporaryFile(); data=os.urandom(1_500_000); f.write(data); f.flush()\n\
        def rx(k):\n    b=bytearray()\n    while len(b)<k: b+=s.recv(1<<20)\n    return bytes(b)\n\
        t=threading.Thread(target=lambda: r.append(rx(len(data)))); r=[]; t.start()\n\
        n=0\n\
        while n<len(data): n+=os.sendfile(c.fileno(), f.fileno(), n, len(data)-n)\n\
        t.join(); assert r[0]==data\n\
        big=[data[:700_000], data[700_000:1_400_000]]\n\
        t=threading.Thread(target=lambda: r.append(rx(1_400_000))); r=[]; t.start()\n\
        n=0\n\
        while n<1_400_000: n+=os.writev(c.fileno(), [memoryview(data)[n:700_000], memoryview(data)[max(n,700_000):1_400_000]] if n<700_000 else [memoryview(data)[n:1_400_000]])\n\
        t.join(); assert r[0]==data[:1_400_000]\n\
        assert os.writev(c.fileno(), [b'abc', b'', b'defg'])==7\n\
        a,b=bytearray(4),bytearray(100)\n\
        got=0\n\
        while got==0:\n    got=os.readv(s.fileno(), [a,b])\n\
        got+=s.recv_into(memoryview(b)[got-4:], 100) if got<7 else 0\n\
        assert got==7 and bytes(a)==b'abcd' and bytes(b[:3])==b'efg' and bytes(b[3:])==bytes(97), (got,a,b[:10])\n");
}

/// `select` without a timeout (iperf3's client loop) waits in the engine
/// like one with a timeout: it used to fall back to the kernel wait, which
/// gave the connection a readiness descriptor and armed its completion
/// queue for good (an engine-thread wake-up per completion after that).
#[test]
fn select_without_a_timeout_waits_in_the_engine_without_a_readiness_descriptor() {
    if !have_python() {
        return;
    }
    run("fds=lambda: len(os.listdir('/proc/self/fd'))\n\
        c.sendall(b'x')\n\
        n0=fds()\n\
        r,w,_=select.select([s],[s],[]); assert r==[s] and w==[s], (r,w)\n\
        assert fds()==n0, (n0, fds())\n\
        assert s.recv(1)==b'x'\n\
        def later(): time.sleep(0.2); c.sendall(b'y')\n\
        t=threading.Thread(target=later); t.start()\n\
        r,_,_=select.select([s],[],[]); t.join(); assert r==[s], r\n\
        assert s.recv(1)==b'y'\n\
        assert fds()==n0, (n0, fds())\n");
}

/// Regression: a destination remembered as plain (no twin answered: a
/// plain server had the port) stayed plain for 60 s although this process
/// then listened on that very port itself, with a twin: its connections to
/// its own listener went plain (and a listener requiring offload dropped
/// them). A preloaded listener's twin now makes the process forget the
/// plain answers it had for its port.
#[test]
fn cached_not_capable_answer_outlived_a_new_preloaded_listener_on_the_port() {
    if !have_python() {
        return;
    }
    // A plain server (not preloaded) on a port the kernel picks: the
    // preloaded client's query is refused, the answer cached, the
    // connection plain. The client closes first (no TIME_WAIT on the
    // listener's side); the process then listens on that port itself.
    let script = "import socket,os,sys,subprocess,select,threading\n\
        env={k:v for k,v in os.environ.items() if k!='LD_PRELOAD'}\n\
        code='import socket\\nl=socket.socket(); l.bind((\"127.0.0.1\",0)); l.listen(1)\\nprint(l.getsockname()[1], flush=True)\\ns,_=l.accept(); s.sendall(s.recv(5, socket.MSG_WAITALL).upper()); s.recv(1)'\n\
        p=subprocess.Popen([sys.executable,'-c',code], env=env, stdout=subprocess.PIPE, text=True)\n\
        port=int(p.stdout.readline())\n\
        c=socket.create_connection(('127.0.0.1',port)); c.sendall(b'plain'); assert c.recv(5, socket.MSG_WAITALL)==b'PLAIN'\n\
        c.close(); assert p.wait(10)==0\n\
        l=socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
        l.bind(('127.0.0.1',port)); l.listen(8)\n\
        r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',port)))); t.start()\n\
        s,_=l.accept(); select.select([],[s],[],5); t.join()\n\
        r[0].sendall(b'again'); assert s.recv(5, socket.MSG_WAITALL)==b'again'\n\
        print('DONE')\n";
    let lines = python_done(script, &[("SOFTRDMA_SOCKETS", "auto")]);
    assert_eq!(
        field(&lines[0], "offloaded"),
        "2",
        "the connection to the process's own listener was switched (both ends): {lines:?}"
    );
    assert!(
        lines[0].contains("\"peer not capable\":1"),
        "only the first connection found no twin: {lines:?}"
    );
}

/// Python: a client connection to port `P` from a thread sending `data`
/// and reading all back (into `r`), and the server's side of it on `x`,
/// which echoes the bytes reversed.
const ECHO_REVERSED: &str = r#"def exchange(x, host, data):
    r=[]
    def cl():
        k=socket.create_connection((host,P)); k.settimeout(10); k.sendall(data); k.shutdown(socket.SHUT_WR); b=bytearray()
        while True:
            y=k.recv(65536)
            if not y: break
            b+=y
        r.append(bytes(b)); k.close()
    t=threading.Thread(target=cl,daemon=True); t.start()
    empty=0
    while True:
        a,_=x.accept(); a.settimeout(10); b=bytearray()
        while True:
            y=a.recv(65536)
            if not y: break
            b+=y
        if b or empty: break
        # A client that saw the twin decide late queries sent its query
        # beside its SYN: unanswered, it closed that connection without a
        # byte and connected again, plain.
        empty+=1; a.close()
    assert bytes(b)==data, len(b)
    a.sendall(data[::-1]); a.close(); t.join(10); assert r==[data[::-1]], [len(v) for v in r]
    return empty
def datagram_reaches(u, to):
    q=socket.socket(socket.AF_INET if '.' in to[0] else socket.AF_INET6, socket.SOCK_DGRAM); q.sendto(b'hello udp', to)
    u.settimeout(5)
    while True:
        d,_=u.recvfrom(100)
        if not d.startswith(b'SRSD'): break
    assert d==b'hello udp', d; q.close()
"#;

/// Regression: a program serving TCP and UDP on one port (DNS, syslog,
/// SIP) that listens on TCP before it binds its UDP socket got
/// `EADDRINUSE` from that bind: the listener's twin held the UDP port.
/// The twin gives way: the bind succeeds, the program's socket gets the
/// datagrams, a connection offloaded before is unaffected, and a new
/// client connects plain, byte-exact.
#[test]
fn a_udp_bind_after_listen_on_the_same_port_failed_with_eaddrinuse() {
    if !have_python() {
        return;
    }
    let lines = run(&format!(
        "{ECHO_REVERSED}\
        x,=free_port((socket.AF_INET,'127.0.0.1',None)); P=x.getsockname()[1]; x.listen(8)\n\
        r=[]; t=threading.Thread(target=lambda: r.append(socket.create_connection(('127.0.0.1',P)))); t.start()\n\
        before,_=x.accept(); select.select([],[before],[],5); t.join()\n\
        u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); u.bind(('127.0.0.1',P))\n\
        datagram_reaches(u, ('127.0.0.1',P))\n\
        r[0].sendall(b'still offloaded'); assert before.recv(100)==b'still offloaded'\n\
        e=exchange(x, '127.0.0.1', os.urandom(300000))\n\
        assert exchange(x, '127.0.0.1', os.urandom(1000))==0, 'remembered plain'\n\
        datagram_reaches(u, ('127.0.0.1',P))\n"
    ));
    // The pair of the prelude and the connection made before the bind.
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// The same with a dual-stack IPv6 listener and an IPv4 wildcard UDP
/// socket (the twin's `[::]` takes the IPv4 port too).
#[test]
fn a_udp_bind_after_a_dual_stack_listen_on_the_same_port_gets_the_port() {
    if !have_python() || std::net::TcpListener::bind("[::1]:0").is_err() {
        return;
    }
    let lines = run(&format!(
        "{ECHO_REVERSED}\
        x,=free_port((socket.AF_INET6,'::',0)); P=x.getsockname()[1]; x.listen(8)\n\
        u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); u.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); u.bind(('0.0.0.0',P))\n\
        datagram_reaches(u, ('127.0.0.1',P))\n\
        exchange(x, '::1', os.urandom(100000))\n\
        exchange(x, '127.0.0.1', os.urandom(100000))\n\
        w=socket.socket(socket.AF_INET6,socket.SOCK_DGRAM); w.setsockopt(socket.IPPROTO_IPV6,socket.IPV6_V6ONLY,1); w.bind(('::1',P))\n\
        datagram_reaches(w, ('::1',P))\n"
    ));
    assert_eq!(field(&lines[0], "offloaded"), "2", "{lines:?}");
}

/// The other order: the program binds its UDP socket first, then listens
/// on the TCP port: the twin cannot start, the listener stays plain and
/// correct, and the program's socket keeps its datagrams; a second UDP
/// bind to the port fails as the kernel says. A UDP bind to a listener's
/// port on an address its twin does not hold leaves the twin running.
#[test]
fn a_listen_after_a_udp_bind_on_the_same_port_stays_plain_and_correct() {
    if !have_python() {
        return;
    }
    let lines = run(&format!(
        "{ECHO_REVERSED}\
        x,=free_port((socket.AF_INET,'127.0.0.1',None)); P=x.getsockname()[1]\n\
        u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); u.bind(('127.0.0.1',P)); x.listen(8)\n\
        exchange(x, '127.0.0.1', os.urandom(200000))\n\
        datagram_reaches(u, ('127.0.0.1',P))\n\
        v=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
        try:\n    v.bind(('127.0.0.1',P)); raise SystemExit('bound twice')\n\
        except OSError as e:\n    assert e.errno==errno.EADDRINUSE, e\n\
        L=l.getsockname()[1]\n\
        v2=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); v2.bind(('127.0.0.2',L)); v2.close()\n\
        c2,s2=connect(); c2.sendall(b'twin kept'); assert s2.recv(100)==b'twin kept'\n"
    ));
    // The pair of the prelude, and one more on its listener: a UDP bind to
    // its port on another address left its twin alone.
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// Twins belong to the process that started them: a forked child's UDP
/// bind to the parent's listener port fails as the kernel says and leaves
/// the parent's twin answering; once the child is gone the parent's own
/// bind gets the port. Sockets with `SO_REUSEPORT` share it among
/// themselves only (the twin never had the option: no datagram of the
/// program goes to it).
#[test]
fn a_forked_childs_udp_bind_leaves_its_parents_twin_and_reuseport_sockets_get_the_port() {
    if !have_python() {
        return;
    }
    let lines = run(&format!(
        "{ECHO_REVERSED}\
        x,=free_port((socket.AF_INET,'127.0.0.1',None)); P=x.getsockname()[1]; x.listen(8)\n\
        pid=os.fork()\n\
        if pid==0:\n    u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n    try:\n        u.bind(('127.0.0.1',P)); os._exit(2)\n    except OSError as e:\n        os._exit(0 if e.errno==errno.EADDRINUSE else 3)\n\
        assert os.waitpid(pid,0)[1]==0\n\
        assert exchange(x, '127.0.0.1', os.urandom(100000))==0\n\
        us=[]\n\
        for i in range(2):\n    u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); u.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEPORT,1); u.bind(('127.0.0.1',P)); us.append(u)\n\
        q=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); got=0\n\
        for i in range(20):\n    q.sendto(b'n', ('127.0.0.1',P))\n\
        for u in us:\n    u.setblocking(False)\n    while True:\n        try: u.recv(10); got+=1\n        except BlockingIOError: break\n\
        assert got==20, got\n"
    ));
    // The pair of the prelude and the connection made before the UDP binds.
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// Regression: a UDP bind to the port of a listener just closed failed
/// with `EADDRINUSE`: the listener's twin was stopped at the close, but its
/// thread held the port until its next read timeout (up to 200 ms), and
/// the twin, no listener's any more, was not one a bind stops.
#[test]
fn a_udp_bind_right_after_closing_a_listener_on_its_port_failed_with_eaddrinuse() {
    if !have_python() {
        return;
    }
    run(
        "x,=free_port((socket.AF_INET,'127.0.0.1',None)); P=x.getsockname()[1]; x.listen(8); x.close()\n\
        u=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); u.bind(('127.0.0.1',P))\n",
    );
}

/// Regression: a listener opened on the port of one just closed (a server
/// that reopens its listening socket) had no twin, and its clients
/// connected plain ("no capability twin"): the old twin's thread still
/// held the UDP port (up to its read timeout, 200 ms) when the new
/// listener's twin was started.
#[test]
fn a_listen_right_after_closing_a_listener_on_its_port_had_no_twin() {
    if !have_python() {
        return;
    }
    let lines = run(&format!(
        "{ECHO_REVERSED}\
        x,=free_port((socket.AF_INET,'127.0.0.1',None),reuse=True); P=x.getsockname()[1]; x.listen(8); x.close()\n\
        y=socket.socket(); y.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); y.bind(('127.0.0.1',P)); y.listen(8)\n\
        exchange(y, '127.0.0.1', os.urandom(3000))\n"
    ));
    // The pair of the prelude and the exchange's connection.
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// Regression: a client gave up waiting for the twin of a server starved
/// past its wait (here: stopped) and connected plain from the port it had
/// named; the resumed twin took the queued query as accepted and the
/// listener switched that plain connection: the client's bytes were read
/// as the switch's, the connection reset. The client now withdraws the
/// query before it connects, and the listener reads the withdraw before it
/// decides: both ends plain, byte-exact.
///
/// The server is resumed once the client's `connect` has returned, and is
/// stopped for certain before the client starts: `kill` returns before the
/// stop is taken (one thread takes it and only then stops the others), and
/// on a busy machine the twin thread still answered the query and both ends
/// were offloaded, as agreed (or the client's switch ran out of time while
/// the server was stopped). The stop is waited for (`waitpid` with
/// `WUNTRACED` reports it once every thread has stopped).
#[test]
fn a_query_the_client_gave_up_on_switched_the_servers_connection() {
    if !have_python() {
        return;
    }
    let script = "import socket,os,sys,subprocess,signal\n\
        code='import socket\\nl=socket.socket(); l.bind((\"127.0.0.1\",0)); l.listen(4)\\nprint(l.getsockname()[1], flush=True)\\ns,_=l.accept(); s.settimeout(10); b=bytearray()\\nwhile True:\\n    y=s.recv(65536)\\n    if not y: break\\n    b+=y\\ns.sendall(bytes(b)[::-1]); s.close()'\n\
        p=subprocess.Popen([sys.executable,'-c',code], stdout=subprocess.PIPE, text=True)\n\
        port=int(p.stdout.readline())\n\
        os.kill(p.pid, signal.SIGSTOP)\n\
        pid,st=os.waitpid(p.pid, os.WUNTRACED); assert os.WIFSTOPPED(st), st\n\
        c=socket.create_connection(('127.0.0.1',port)); c.settimeout(10)\n\
        os.kill(p.pid, signal.SIGCONT)\n\
        data=os.urandom(200000); c.sendall(data); c.shutdown(socket.SHUT_WR); b=bytearray()\n\
        while True:\n    y=c.recv(65536)\n    if not y: break\n    b+=y\n\
        assert bytes(b)==data[::-1], len(b)\n\
        assert p.wait(10)==0\n\
        print('DONE')\n";
    let lines = python_done(script, &[("SOFTRDMA_SOCKETS", "auto")]);
    assert_eq!(lines.len(), 2, "{lines:?}");
    for l in &lines {
        assert_eq!(field(l, "offloaded"), "0", "both ends plain: {lines:?}");
        assert_eq!(field(l, "plain"), "1", "both ends plain: {lines:?}");
    }
    // The client heard nothing (it gave up), the server was asked nothing
    // it kept (the withdraw).
    assert!(
        lines.iter().any(|l| l.contains("\"peer not capable\":1")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("\"client did not ask for offload\":1")),
        "{lines:?}"
    );
}

/// The process's stats line: `n` connection ends offloaded, no switch
/// failed (a program connecting to itself).
fn offloaded_with_no_failed_setup(lines: &[String], n: &str) {
    assert_eq!(field(&lines[0], "offloaded"), n, "{lines:?}");
    assert!(!lines[0].contains("offload setup failed"), "{lines:?}");
}

/// A client's `connect` returns once its MPA Request is sent, not once the
/// server has switched: a program that connects to itself and accepts only
/// afterwards, in the same thread, gets an offloaded connection at once
/// when its server end is used first (here it speaks first); it waited
/// for the switch's 5 s limit in `connect` and then connected plain.
#[test]
fn a_program_connecting_to_itself_and_accepting_later_in_the_same_thread_is_offloaded() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        t0=time.monotonic()\n\
        x=socket.create_connection(('127.0.0.1',l.getsockname()[1]))\n\
        assert time.monotonic()-t0 < 2, time.monotonic()-t0\n\
        y,_=l.accept()\n\
        y.sendall(b'hello'); assert x.recv(5, socket.MSG_WAITALL)==b'hello'\n\
        x.sendall(b'to myself'); assert y.recv(9, socket.MSG_WAITALL)==b'to myself'\n\
        y.sendall(b'and back'); assert x.recv(8, socket.MSG_WAITALL)==b'and back'\n\
        assert time.monotonic()-t0 < 3, time.monotonic()-t0\n");
    offloaded_with_no_failed_setup(&lines, "4");
}

/// A program that connects to itself, accepts in the same thread and then
/// uses the client's end first (a write, then a read of the answer) was
/// reset: the write waited for the server's Reply, which only this thread
/// could send by using the accepted end, gave up after the switch's 5 s,
/// and connected again plain, while the program read on the accepted end,
/// the connection given up. The client's wait switches the accepted end
/// itself now. The same with `create_connection` and a listener of
/// backlog 1.
#[test]
fn a_program_connecting_to_itself_and_writing_on_the_client_first_is_not_reset() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        t0=time.monotonic()\n\
        x=socket.socket(); x.connect(('127.0.0.1',l.getsockname()[1]))\n\
        y,_=l.accept()\n\
        data=os.urandom(100000); x.sendall(data)\n\
        assert y.recv(100000, socket.MSG_WAITALL)==data\n\
        y.sendall(b'back'); assert x.recv(4, socket.MSG_WAITALL)==b'back'\n\
        l1=socket.socket(); l1.bind(('127.0.0.1',0)); l1.listen(1)\n\
        x1=socket.create_connection(('127.0.0.1',l1.getsockname()[1]))\n\
        y1,_=l1.accept()\n\
        x1.sendall(b'hello'); assert y1.recv(5, socket.MSG_WAITALL)==b'hello'\n\
        y1.sendall(b'back'); assert x1.recv(4, socket.MSG_WAITALL)==b'back'\n\
        assert time.monotonic()-t0 < 3, time.monotonic()-t0\n");
    offloaded_with_no_failed_setup(&lines, "6");
}

/// The same with a non-blocking client: `connect` in progress, the
/// accept, then a `poll` of both ends for writing (the client's end is
/// writable once its switch is finished, which needs the accepted end
/// switched by the same thread), both written, then both read.
#[test]
fn a_program_connecting_to_itself_non_blocking_and_polling_both_ends_is_not_reset() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        t0=time.monotonic()\n\
        x=socket.socket(); x.setblocking(False)\n\
        assert x.connect_ex(('127.0.0.1',l.getsockname()[1])) in (0, errno.EINPROGRESS)\n\
        y,_=l.accept(); y.setblocking(False)\n\
        p=select.poll(); p.register(x, select.POLLOUT)\n\
        assert p.poll(5000)==[(x.fileno(), select.POLLOUT)]\n\
        assert x.send(b'hello')==5\n\
        select.select([],[y],[],5); assert y.send(b'back')==4\n\
        select.select([y],[],[],5); assert y.recv(5)==b'hello'\n\
        select.select([x],[],[],5); assert x.recv(4)==b'back'\n\
        assert time.monotonic()-t0 < 3, time.monotonic()-t0\n");
    offloaded_with_no_failed_setup(&lines, "4");
}

/// A program that connects to itself and writes on the client's end
/// before it accepts (in the same thread; the bytes fit the socket
/// buffer, as with TCP) was reset: the client gave up its switch after
/// the switch's 5 s and connected again plain, and the accept returned
/// the connection given up, whose switch then failed. That connection is
/// closed by the accept now, which returns the plain one: the bytes
/// arrive whole, both ways, plain (after the 5 s: no thread of the
/// program answers the switch before the accept).
#[test]
fn a_program_connecting_to_itself_and_writing_before_it_accepts_is_not_reset() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        x=socket.create_connection(('127.0.0.1',l.getsockname()[1]))\n\
        data=os.urandom(20000); x.sendall(data)\n\
        y,peer=l.accept(); assert peer==x.getsockname(), (peer, x.getsockname())\n\
        assert y.recv(20000, socket.MSG_WAITALL)==data\n\
        y.sendall(b'back'); assert x.recv(4, socket.MSG_WAITALL)==b'back'\n\
        x.close(); assert y.recv(1)==b''\n\
        l.setblocking(False)\n\
        try:\n    l.accept(); assert False, 'a second connection'\n\
        except BlockingIOError: pass\n");
    let l = &lines[0];
    assert_eq!(field(l, "offloaded"), "2", "{lines:?}");
    assert!(l.contains("\"offload setup failed\":1"), "{lines:?}");
}

/// A connection given up before it was accepted is skipped by an accept
/// on its own listener only: after that listener is closed without
/// accepting, a new listener on the same port accepts a connection from
/// the old client's address (it used to close it, the entry kept forever).
#[test]
fn a_given_up_self_connect_whose_listener_closes_unaccepted_does_not_skip_a_later_connection() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        port=l.getsockname()[1]\n\
        x=socket.create_connection(('127.0.0.1',port)); old=x.getsockname()\n\
        x.sendall(b'first')\n\
        x.close(); l.close()\n\
        b=socket.socket(); b.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
        b.bind(('127.0.0.1',port)); b.listen(8)\n\
        y=socket.socket(); y.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
        y.bind(old); y.connect(('127.0.0.1',port))\n\
        b.settimeout(8); a,peer=b.accept(); assert peer==old, (peer, old)\n\
        y.sendall(b'again'); assert a.recv(5, socket.MSG_WAITALL)==b'again'\n");
    assert!(lines[0].contains("\"offload setup failed\":1"), "{lines:?}");
}

/// `connect` returns before the server has accepted (the server's switch
/// is made on its first use, later; the server accepts only once
/// `connect` has returned, which must take under 2 s, well short of the
/// switch's 5 s time limit); a write right after it waits for the
/// server's MPA Reply and its bytes arrive whole, offloaded.
#[test]
fn connect_returns_before_the_server_switches_and_a_write_before_the_reply_is_byte_exact() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        connected=threading.Event(); got=[]\n\
        def server():\n    connected.wait(10); a,_=l.accept(); got.append(a.recv(100000, socket.MSG_WAITALL)); a.sendall(b'ok'); got.append(a)\n\
        t=threading.Thread(target=server); t.start()\n\
        t0=time.monotonic(); x=socket.create_connection(('127.0.0.1',l.getsockname()[1]))\n\
        dt=time.monotonic()-t0; connected.set(); assert dt < 2, dt\n\
        data=os.urandom(100000); x.sendall(data)\n\
        assert x.recv(2, socket.MSG_WAITALL)==b'ok'\n\
        t.join(); assert got[0]==data\n");
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// A non-blocking connect's socket is not reported writable (epoll, poll)
/// before its switch is finished: not while the server has not switched;
/// then it is, and the bytes go offloaded.
#[test]
fn a_non_blocking_connect_is_writable_only_once_its_switch_is_finished() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        x=socket.socket(); x.setblocking(False)\n\
        assert x.connect_ex(('127.0.0.1',l.getsockname()[1]))==errno.EINPROGRESS\n\
        ep=select.epoll(); ep.register(x.fileno(), select.EPOLLOUT)\n\
        assert ep.poll(0.3)==[], 'writable before the server switched'\n\
        got=[]\n\
        def server():\n    a,_=l.accept(); select.select([a],[],[],5); got.append(a.recv(5)); got.append(a)\n\
        t=threading.Thread(target=server); t.start()\n\
        ev=ep.poll(5); assert ev==[(x.fileno(), select.EPOLLOUT)], ev\n\
        p=select.poll(); p.register(x, select.POLLOUT); assert p.poll(0)==[(x.fileno(), select.POLLOUT)]\n\
        assert x.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)==0\n\
        x.send(b'hello'); t.join(); assert got[0]==b'hello'\n");
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// A switch that fails after `connect` returned (the server closed the
/// accepted connection without using it) is found at the first write: a
/// fresh plain connection takes the descriptor before any application
/// byte, the bytes arrive on it whole, and the reason is counted.
#[test]
fn a_switch_failing_after_connect_returned_falls_back_plain_at_the_first_write() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        t0=time.monotonic()\n\
        x=socket.create_connection(('127.0.0.1',l.getsockname()[1]))\n\
        assert time.monotonic()-t0 < 2, time.monotonic()-t0\n\
        fd=x.fileno(); x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
        a,_=l.accept(); a.close()\n\
        data=os.urandom(50000); x.sendall(data)\n\
        assert x.fileno()==fd and x.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)==1\n\
        b,_=l.accept(); assert b.getpeername()==x.getsockname()\n\
        assert b.recv(50000, socket.MSG_WAITALL)==data\n\
        b.sendall(b'plain'); assert x.recv(5, socket.MSG_WAITALL)==b'plain'\n");
    let l = &lines[0];
    assert_eq!(field(l, "offloaded"), "2", "{lines:?}");
    assert!(l.contains("\"offload setup failed\":1"), "{lines:?}");
    assert!(
        l.contains("\"client did not ask for offload\":1"),
        "{lines:?}"
    );
}

/// Closing a connection whose switch was never finished leaves no
/// descriptor behind, and the server's end sees the connection end (reset
/// or end of stream), not a hang.
#[test]
fn closing_a_connection_before_its_first_use_leaks_nothing_and_ends_the_servers() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        def fds(): return len(os.listdir('/proc/self/fd'))\n\
        port=l.getsockname()[1]\n\
        x=socket.create_connection(('127.0.0.1',port)); x.close()\n\
        a,_=l.accept()\n\
        try:\n    assert a.recv(1)==b''\n\
        except ConnectionResetError: pass\n\
        a.close(); n=fds()\n\
        for i in range(10):\n    x=socket.create_connection(('127.0.0.1',port)); x.close(); a,_=l.accept(); a.close()\n\
        t0=time.monotonic()\n\
        while fds()!=n and time.monotonic()-t0 < 5: time.sleep(0.05)\n\
        assert fds()==n, (fds(), n)\n");
    assert!(!lines[0].contains("offload setup failed"), "{lines:?}");
}

/// A child forked before the connection's first use gets `EIO` (the
/// parent's connection, as for a switched one) and does not take the
/// server's MPA Reply: the parent finishes the switch and its bytes go
/// offloaded.
#[test]
fn a_child_forked_before_the_first_use_leaves_the_switch_to_its_parent() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        x=socket.create_connection(('127.0.0.1',l.getsockname()[1]))\n\
        a,_=l.accept(); select.select([a],[],[],0)\n\
        pid=os.fork()\n\
        if pid==0:\n\
        \x20   try:\n\
        \x20       x.send(b'child'); os._exit(3)\n\
        \x20   except OSError as e:\n\
        \x20       x.close(); os._exit(0 if e.errno==errno.EIO else 4)\n\
        assert os.waitpid(pid,0)[1]==0\n\
        x.sendall(b'parent'); assert a.recv(6, socket.MSG_WAITALL)==b'parent'\n\
        a.sendall(b'back'); assert x.recv(4, socket.MSG_WAITALL)==b'back'\n");
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// A switch failing at first use puts its plain connection only on the
/// connection's descriptors that are still its socket: the number
/// `connect` was called with, closed after a `dup` and taken by a file,
/// stays the file (the plain reconnect's `dup3` replaced the file there
/// and the application lost it), and the bytes go on the `dup`.
#[test]
fn a_failure_at_first_use_reconnects_onto_a_descriptor_number_the_application_no_longer_owns() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        import stat, tempfile\n\
        x=socket.create_connection(('127.0.0.1',l.getsockname()[1]))\n\
        fd=x.fileno(); y=socket.socket(fileno=os.dup(fd)); x.close()\n\
        f=tempfile.TemporaryFile(); assert f.fileno()==fd, (f.fileno(), fd)\n\
        f.write(b'file'); f.flush()\n\
        a,_=l.accept(); a.close()\n\
        data=os.urandom(50000); y.sendall(data)\n\
        assert stat.S_ISREG(os.fstat(fd).st_mode), 'the file was replaced'\n\
        f.seek(0); assert f.read()==b'file'\n\
        b,_=l.accept(); assert b.getpeername()==y.getsockname()\n\
        assert b.recv(50000, socket.MSG_WAITALL)==data\n\
        b.sendall(b'plain'); assert y.recv(5, socket.MSG_WAITALL)==b'plain'\n");
    assert!(lines[0].contains("\"offload setup failed\":1"), "{lines:?}");
}

/// `epoll_wait` with timeout 0 returns at once while another thread
/// finishes a connection's switch (its write waits for the server's MPA
/// Reply): the wait looked at the connection under the instance's lock
/// and waited for the switch's lock, up to the switch's 5 s limit.
#[test]
fn epoll_wait_0_blocks_while_another_thread_finishes_the_switch() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        x=socket.socket(); x.setblocking(False)\n\
        assert x.connect_ex(('127.0.0.1',l.getsockname()[1]))==errno.EINPROGRESS\n\
        ep=select.epoll(); ep.register(x.fileno(), select.EPOLLOUT)\n\
        def tx():\n    select.select([],[x],[],5); x.send(b'hello')\n\
        t=threading.Thread(target=tx); t.start(); time.sleep(0.5)\n\
        t0=time.monotonic(); ev=ep.poll(0); dt=time.monotonic()-t0\n\
        assert dt < 0.5, ('epoll_wait(0) took', dt)\n\
        a,_=l.accept(); select.select([a],[],[],5); assert a.recv(5, socket.MSG_WAITALL)==b'hello'\n\
        t.join(); ev=ep.poll(5); assert ev==[(x.fileno(), select.EPOLLOUT)], ev\n");
    assert_eq!(field(&lines[0], "offloaded"), "4", "{lines:?}");
}

/// A C client for the test below: connects to 127.0.0.1:`argv[1]`, then
/// one thread waits on an epoll instance of the connection with timeout 0
/// in a loop while the other sets `TCP_NODELAY` off and reads it back, so
/// many times; exits 0 if every read gave 0 and no one set-and-get pair
/// took over 2 s.
const NODELAY_WHILE_EPOLL_C: &str = r#"#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int ep;
static volatile int stop;

static void *spin(void *arg) {
    (void)arg;
    struct epoll_event ev;
    while (!stop)
        epoll_wait(ep, &ev, 1, 0);
    return NULL;
}

int main(int argc, char **argv) {
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(atoi(argv[1]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
        return 2;
    ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    pthread_t t;
    pthread_create(&t, NULL, spin, NULL);
    int bad = 0, zero = 0;
    double worst = 0;
    for (int i = 0; i < 100000; i++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &zero, sizeof zero);
        int v = 0;
        socklen_t len = sizeof v;
        getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &v, &len);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        bad += v != 0;
        double dt = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
        if (dt > worst)
            worst = dt;
    }
    stop = 1;
    pthread_join(t, NULL);
    printf("%d %f\n", bad, worst);
    fflush(stdout);
    _exit(bad == 0 && worst < 2 ? 0 : 1);
}
"#;

/// Before the first use, `setsockopt(TCP_NODELAY)` and
/// `getsockopt(TCP_NODELAY)` keep the application's setting while another
/// thread merely looks at the connection (an `epoll_wait(0)` loop holds
/// the switch's lock a moment): a busy lock was taken for a finish in
/// progress, so a set finished the switch itself (waiting out the
/// switch's 5 s limit for a Reply the server had not sent, then plain) and
/// a get reported the kernel socket's 1. (Skipped without a C compiler.)
#[test]
fn unfinished_and_pending_nodelay_answer_wrongly_when_the_lock_is_merely_busy() {
    if !have_python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = compile_c(
        dir.path(),
        "busy",
        NODELAY_WHILE_EPOLL_C,
        &["-O1", "-pthread"],
    ) else {
        return;
    };
    let lines = run(&format!(
        "c.close(); s.close()\n\
         import subprocess\n\
         p=subprocess.run([{exe:?}, str(l.getsockname()[1])], capture_output=True, text=True)\n\
         assert p.returncode==0, (p.returncode, p.stdout, p.stderr)\n\
         a,_=l.accept(); a.close()\n",
        exe = exe.display().to_string()
    ));
    assert!(!lines[0].contains("offload setup failed"), "{lines:?}");
}

/// A connection closed right after `connect`, before its first use, while
/// the server uses its end at once: the close waits a moment for the
/// server's MPA Reply, finishes the switch and closes in order (the
/// server reads the end of the stream); it aborted the switch, and the
/// server's end was reset.
#[test]
fn a_close_before_first_use_races_the_reply_and_resets_the_servers_end() {
    if !have_python() {
        return;
    }
    let lines = run("c.close(); s.close()\n\
        got=[]\n\
        def server():\n    a,_=l.accept()\n    try: got.append(a.recv(1))\n    except ConnectionResetError: got.append('reset')\n    a.close()\n\
        for i in range(5):\n    t=threading.Thread(target=server); t.start()\n    x=socket.create_connection(('127.0.0.1',l.getsockname()[1])); x.close(); t.join()\n\
        assert got==[b'']*5, got\n");
    assert!(!lines[0].contains("offload setup failed"), "{lines:?}");
}
