"""Does a capture into a pool whose graphs were all freed fail with a bare graph_pool_handle() and work with a
torch.cuda.MemPool? (the failure behind test_decode_slots' flaky capture, 2026-12-06)"""

import gc

import torch


def capture(pool_id):
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool_id):
        y = x * 2 + 1
    g.replay()
    torch.cuda.synchronize()
    return g, y


for name, make in (
    ("graph_pool_handle", lambda: (None, torch.cuda.graph_pool_handle())),
    ("MemPool", lambda: ((p := torch.cuda.MemPool()), p.id)),
):
    keep, pid = make()
    g, y = capture(pid)
    del g  # the graph freed, a tensor its capture allocated in the pool still alive (as y here)
    gc.collect()
    try:
        g, y = capture(pid)
        print(f"{name}: second capture after the first graph was freed: ok, {float(y[0])}")
    except RuntimeError as e:
        print(f"{name}: second capture after the first graph was freed: RuntimeError: {str(e).splitlines()[0][:150]}")
