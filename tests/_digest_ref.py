"""The 64-bit tile digest (``memsem_digest``, native/memsem_delta.c) written out in plain Python,
word by word: the function every native implementation must compute (a writer with AVX2 and a
reader without compare digests), pinned here so that a change to any of them is seen."""
from __future__ import annotations

M = (1 << 64) - 1
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                      0x27D4EB2F165667C5)
KEY = (0xbe4ba423396cfeb8, 0x1cad21f72c81017c, 0xdb979083e96dd4de, 0x1f67b3b7a4a44072,
       0x78e5c0cc4ee679cb, 0x2172ffcc7dd05a82, 0x8e2443f7744608b8, 0x4c263a81e69035e0)
PRIME32 = 0x9E3779B1


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M


def _round(acc: int, v: int) -> int:
    acc = _rotl((acc + v * P2) & M, 31)
    return (acc * P1) & M


def _word(b: bytes, at: int) -> int:
    return int.from_bytes(b[at:at + 8], "little")


def digest(b: bytes, seed: int = 0) -> int:
    """``memsem_digest`` of ``b`` with ``seed``."""
    acc = [P3, P1, P2, P4, P5, P3 ^ seed, P2 ^ seed, P1 ^ seed]
    n = len(b)
    stripes = n // 64
    for s in range(stripes):  # 64-byte stripes into 8 lanes
        for i in range(8):
            v = _word(b, 64 * s + 8 * i)
            k = v ^ KEY[i]
            acc[i ^ 1] = (acc[i ^ 1] + v) & M
            acc[i] = (acc[i] + (k & 0xFFFFFFFF) * (k >> 32)) & M
        if (s + 1) % 16 == 0:  # every kilobyte the lanes are scrambled
            for i in range(8):
                a = acc[i] ^ (acc[i] >> 47) ^ KEY[i]
                acc[i] = (a * PRIME32) & M
    h = (seed + P5 + n) & M
    for i in range(8):
        h ^= _round(0, acc[i])
        h = (_rotl(h, 27) * P1 + P4) & M
    p = stripes * 64
    while p + 8 <= n:
        h ^= _round(0, _word(b, p))
        h = (_rotl(h, 27) * P1 + P4) & M
        p += 8
    while p < n:
        h ^= (b[p] * P5) & M
        h = (_rotl(h, 11) * P1) & M
        p += 1
    h ^= h >> 33
    h = (h * P2) & M
    h ^= h >> 29
    h = (h * P3) & M
    return h ^ (h >> 32)
