"""RL dataflow over memsem: rollouts produce sample fields tile by tile, a trainer streams them.

Two rollout processes (one fast, one slow) each publish a FieldSet for their share of the batch
(``prompts``, ``responses``, ``logprobs``, ``rewards``, different dtypes and shapes, ready per tile
of ``--tile-rows`` rows) and hand its small serialized form to the trainer over a pipe. They then
fill the fields tile by tile at their own speed. The trainer streams each rollout's ``logprobs``
through a double-buffer pipeline (tile i+1 moves while tile i is computed), fetches the matching
rewards and responses rows as they become ready, and accumulates a policy-gradient style loss.
At the end it recomputes the same loss on the whole data (regenerated independently) and checks
that both agree; it exits with status 1 if they do not.

Run: ``python examples/rl_dataflow.py`` (``--small`` for the test-sized run, ``--backend torch``
to compute with torch when installed).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import traceback

import numpy as np

import memsem

VOCAB = 32000


def make_rows(rollout: int, start: int, stop: int, prompt_len: int, response_len: int) -> dict[str, np.ndarray]:
    """Deterministic sample rows ``[start, stop)`` of one rollout (what its policy "generated")."""
    out = {"prompts": [], "responses": [], "logprobs": [], "rewards": []}
    for row in range(start, stop):
        rng = np.random.default_rng([rollout, row])
        n = int(rng.integers(response_len // 2, response_len + 1))  # response length; 0 = padding
        resp = np.zeros(response_len, np.int32)
        resp[:n] = rng.integers(1, VOCAB, n, dtype=np.int32)
        lp = np.zeros(response_len, np.float32)
        lp[:n] = -rng.exponential(1.0, n).astype(np.float32)
        out["prompts"].append(rng.integers(1, VOCAB, prompt_len, dtype=np.int32))
        out["responses"].append(resp)
        out["logprobs"].append(lp)
        out["rewards"].append(np.float32(rng.normal()))
    return {k: np.stack(v) if k != "rewards" else np.array(v, np.float32) for k, v in out.items()}


def rollout_main(conn, rollout: int, rows: int, tile_rows: int, prompt_len: int, response_len: int,
                 delay: float) -> None:
    """A rollout worker: publish its FieldSet, send it, fill it tile by tile, wait for 'done'."""
    try:
        with memsem.Runtime() as rt:
            fields = {
                "prompts": np.zeros((rows, prompt_len), np.int32),
                "responses": np.zeros((rows, response_len), np.int32),
                "logprobs": np.zeros((rows, response_len), np.float32),
                "rewards": np.zeros(rows, np.float32),
            }
            fs = rt.publish_fields(fields, tile_rows=tile_rows, name=f"rollout{rollout}")
            conn.send(("fields", fs.to_bytes()))
            if conn.recv() != "go":
                return
            for t in range(fs["prompts"].n_tiles):
                r0, r1 = fs["prompts"].schema.rows_of_tile(t)
                data = make_rows(rollout, r0, r1, prompt_len, response_len)
                time.sleep(delay / 2)                           # "generation"
                fs["prompts"].put_rows(r0, data["prompts"])     # each put marks its tile ready
                fs["responses"].put_rows(r0, data["responses"])
                fs["logprobs"].put_rows(r0, data["logprobs"])
                time.sleep(delay / 2)                           # "reward model"
                fs["rewards"].put_rows(r0, data["rewards"])
            if not conn.poll(300) or conn.recv() != "done":
                print(f"rollout {rollout}: trainer did not finish", file=sys.stderr)
            fs.unpublish(timeout=10)
            conn.send(("bye", rollout))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def loss_terms(logprobs, responses, rewards, backend: str):
    """Policy-gradient style loss terms of some rows: (-sum(reward * logprob over response
    tokens), token count). float64 accumulation so tile sums and whole sums agree."""
    if backend == "torch":
        import torch

        lp = torch.from_numpy(np.ascontiguousarray(logprobs)).double()
        mask = torch.from_numpy(np.ascontiguousarray(responses)) > 0
        rw = torch.from_numpy(np.ascontiguousarray(rewards)).double()
        return float(-(rw[:, None] * lp * mask).sum()), int(mask.sum())
    mask = responses > 0
    return float(-(rewards.astype(np.float64)[:, None] * logprobs.astype(np.float64) * mask).sum()), int(mask.sum())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512, help="rows (samples) per rollout")
    ap.add_argument("--tile-rows", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--fast-delay", type=float, default=0.004, help="seconds per tile, fast rollout")
    ap.add_argument("--slow-delay", type=float, default=0.012, help="seconds per tile, slow rollout")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--backend", choices=["auto", "numpy", "torch"], default="auto")
    ap.add_argument("--small", action="store_true", help="test-sized run")
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    if a.small:
        a.rows, a.tile_rows, a.prompt_len, a.response_len = 64, 8, 16, 32
        a.fast_delay, a.slow_delay = 0.002, 0.006
    backend = a.backend
    if backend == "auto":
        import importlib.util

        backend = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    if backend == "torch":
        import torch  # noqa: F401  (imported before the timed part)

    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for r, delay in enumerate((a.fast_delay, a.slow_delay)):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=rollout_main, args=(child, r, a.rows, a.tile_rows, a.prompt_len,
                                                   a.response_len, delay), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)

    def recv(conn, what):
        if not conn.poll(a.timeout):
            raise TimeoutError(f"no {what} from a rollout within {a.timeout} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError("rollout failed:\n" + msg[1])
        return msg

    ok = False
    try:
        with memsem.Runtime(timeout=a.timeout) as rt:
            sets = [memsem.FieldSet.from_bytes(recv(c, "field set")[1], rt) for c in conns]
            print(f"trainer: {len(sets)} rollouts, backend {backend}")
            for fs in sets:
                print(f"  {fs!r}")
            t0 = time.perf_counter()
            for c in conns:
                c.send("go")
            loss, tokens = 0.0, 0
            stats = []
            for fs in sets:
                with fs["logprobs"].pipeline(depth=a.depth) as pipe:
                    for tile in pipe:
                        with tile:
                            r0, r1 = tile.rows
                            rewards = fs["rewards"].get_rows(r0, r1, wait=True)
                            responses = fs["responses"].get_rows(r0, r1, wait=True)
                            l, n = loss_terms(tile.array, responses, rewards, backend)
                            loss += l
                            tokens += n
                stats.append((fs.name, pipe.stats))
                done = [f.name for f in fs.as_ready(timeout=a.timeout)]
                assert sorted(done) == sorted(fs.fields), done
            elapsed = time.perf_counter() - t0
            streamed = loss / max(tokens, 1)

            # The same computation on the whole data, regenerated independently.
            w_loss, w_tokens = 0.0, 0
            for r, fs in enumerate(sets):
                whole = make_rows(r, 0, a.rows, a.prompt_len, a.response_len)
                got = {k: fs[k].get() for k in fs}
                for k in whole:
                    if not np.array_equal(got[k], whole[k]):
                        raise AssertionError(f"rollout {r} field {k}: received data differs from what was produced")
                l, n = loss_terms(whole["logprobs"], whole["responses"], whole["rewards"], backend)
                w_loss += l
                w_tokens += n
            expected = w_loss / max(w_tokens, 1)
            for name, st in stats:
                print(f"  {name}: {st.tiles} tiles, first tile {st.first_tile_s * 1e3:.2f} ms, "
                      f"waited for producer {st.ready_wait_s * 1e3:.1f} ms, moved {st.bytes_moved} B "
                      f"({st.mode}, {st.route}), overlap {st.overlap_ratio:.2f}")
            print(f"trainer: streamed loss {streamed:.9f} over {tokens} tokens in {elapsed * 1e3:.1f} ms; "
                  f"whole-data loss {expected:.9f} over {w_tokens} tokens")
            ok = tokens == w_tokens and abs(streamed - expected) <= 1e-9 * max(1.0, abs(expected))
            for c in conns:
                c.send("done")
            for c in conns:
                recv(c, "goodbye")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    if ok:
        print("OK: result matches the whole-data computation")
        return 0
    print("MISMATCH: streamed result differs from the whole-data computation", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
