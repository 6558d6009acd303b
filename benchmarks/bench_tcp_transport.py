"""Why the tcp engine uses blocking sockets: 64 B request/response and 64 MiB reads over
loopback, a blocking socket (TCP_NODELAY, recv_into) against asyncio streams, same run, two
rounds; server in another process. Recorded in docs/many-nodes.md.

    python benchmarks/bench_tcp_transport.py
"""
import asyncio, socket, statistics, threading, time, struct
N=2000; BIG=64<<20
payload=bytes(BIG)
def sock_server(port_box, ready):
    ls=socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR,1); ls.bind(("127.0.0.1",0)); ls.listen()
    port_box.append(ls.getsockname()[1]); ready.set()
    c,_=ls.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY,1)
    hdr=bytearray(8)
    mv=memoryview(payload)
    while True:
        n=c.recv_into(hdr, 8, socket.MSG_WAITALL)
        if n<8: break
        (sz,)=struct.unpack("<Q",hdr)
        c.sendall(mv[:sz])
    c.close(); ls.close()
def sock_client(port):
    s=socket.create_connection(("127.0.0.1",port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY,1)
    small=bytearray(64); big=bytearray(BIG)
    def get(buf, sz):
        s.sendall(struct.pack("<Q",sz)); mv=memoryview(buf); got=0
        while got<sz: got+=s.recv_into(mv[got:sz])
    for _ in range(200): get(small,64)
    t=[]
    for _ in range(N):
        a=time.perf_counter_ns(); get(small,64); t.append(time.perf_counter_ns()-a)
    bt=[]
    for _ in range(5):
        a=time.perf_counter(); get(big,BIG); bt.append(time.perf_counter()-a)
    s.close()
    return statistics.median(t)/1e3, BIG/min(bt)/1e9
# the asyncio server runs its own loop in another process, as an owner would
def aio_server_thread(port_box, ready):
    async def run():
        async def handle(r,w):
            try:
                while True:
                    hdr=await r.readexactly(8)
                    (sz,)=struct.unpack("<Q",hdr)
                    w.write(memoryview(payload)[:sz]); await w.drain()
            except asyncio.IncompleteReadError:
                w.close()
        srv=await asyncio.start_server(handle,"127.0.0.1",0)
        port_box.append(srv.sockets[0].getsockname()[1]); ready.set()
        await asyncio.sleep(3600)
    asyncio.run(run())
async def aio_client(port):
    r,w=await asyncio.open_connection("127.0.0.1",port, limit=1<<22)
    w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY,1)
    big=bytearray(BIG)
    async def get(sz, into=None):
        w.write(struct.pack("<Q",sz)); await w.drain()
        data=await r.readexactly(sz)
        if into is not None: memoryview(into)[:sz]=data
    for _ in range(200): await get(64)
    t=[]
    for _ in range(N):
        a=time.perf_counter_ns(); await get(64); t.append(time.perf_counter_ns()-a)
    bt=[]
    for _ in range(5):
        a=time.perf_counter(); await get(BIG, big); bt.append(time.perf_counter()-a)
    w.close()
    return statistics.median(t)/1e3, BIG/min(bt)/1e9
import multiprocessing as mp
def run_sock_server(q):
    box=[];ev=threading.Event()
    th=threading.Thread(target=sock_server,args=(box,ev)); th.start(); ev.wait(); q.put(box[0]); th.join()
def run_aio_server(q):
    box=[];ev=threading.Event()
    th=threading.Thread(target=aio_server_thread,args=(box,ev),daemon=True); th.start(); ev.wait(); q.put(box[0]); time.sleep(120)
if __name__=="__main__":
    for rnd in range(2):
        q=mp.Queue(); p=mp.Process(target=run_sock_server,args=(q,)); p.start(); port=q.get()
        s=sock_client(port); p.join(10)
        q=mp.Queue(); p=mp.Process(target=run_aio_server,args=(q,)); p.start(); port=q.get()
        a=asyncio.run(aio_client(port)); p.kill(); p.join()
        print(f"round {rnd}: socket 64B {s[0]:.1f} us, 64MiB {s[1]:.2f} GB/s | asyncio streams 64B {a[0]:.1f} us ({a[0]/s[0]:.2f}x), 64MiB {a[1]:.2f} GB/s ({a[1]/s[1]:.2f}x)")
