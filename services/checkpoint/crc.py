"""The manifest's checksum (zlib crc32), and the crc32 of a whole object from its parts' crc32s.

`checksum` is the one function every writer and reader of a checkpoint hashes bytes with.

A shard's manifest entry lists the crc32 of every inner chunk (so a partial read verifies just
the chunks it fetches) and of the whole object (so `ckpt verify` and whole-object reads check
one number). Hashing the data twice would cost a second pass over every saved byte;
`crc32_combine` is zlib's crc32_combine (crc32.c, x2nmodp/multmodp), which turns
crc(A), crc(B), len(B) into crc(A + B) with a few dozen integer operations.

    crc = 0
    for part in parts:
        crc = crc32_combine(crc, zlib.crc32(part), len(part))
    assert crc == zlib.crc32(b"".join(parts))
"""

from __future__ import annotations

import functools
import zlib


def checksum(data: bytes | memoryview) -> int:
    """The checksum the manifest records for an object, an inner chunk or a shard index."""
    return zlib.crc32(data)


_POLY = 0xEDB88320  # reflected crc32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the crc polynomial (reflected bit order, as in zlib)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # _X2N[k] = x^(2^k) mod p


@functools.lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) mod p: appending nbytes zero bytes (cached: chunks repeat one size)."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """Returns zlib.crc32(A + B) given crc1 = zlib.crc32(A), crc2 = zlib.crc32(B), len2 = len(B)."""
    return _multmodp(_shift(len2), crc1) ^ crc2
