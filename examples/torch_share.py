"""Wrap a torch tensor in one process and read it from another (same node).

Run: python examples/torch_share.py
"""
import multiprocessing as mp

import memsem


def reader(ref_bytes: bytes, q) -> None:
    with memsem.Runtime() as rt:
        ref = rt.ref(ref_bytes)          # resolve the small serialized ref
        t = ref.get()                    # a torch tensor again (bf16 stays bf16)
        q.put((str(t.dtype), tuple(t.shape), t.float().sum().item(), rt.explain(ref)))


if __name__ == "__main__":
    try:
        import torch
    except ImportError:
        raise SystemExit("this example needs torch (pip install torch==2.13.0, the version memsem is tested with)")
    weights = torch.randn(1024, 256).to(torch.bfloat16)
    with memsem.Runtime() as rt:
        ref = rt.publish(weights, name="weights", access="r")   # in place, no copy
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=reader, args=(ref.to_bytes(), q))
        p.start()
        dtype, shape, total, how = q.get(timeout=60)
        p.join(timeout=30)
        print(f"reader got {dtype} {shape}; {how.splitlines()[0]}")
        ok = dtype == "torch.bfloat16" and abs(total - weights.float().sum().item()) < 1e-3
        print("bit-exact" if ok else "MISMATCH")
        raise SystemExit(0 if ok else 1)
