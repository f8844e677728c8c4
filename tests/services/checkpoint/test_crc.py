"""crc32_combine: the whole object's crc32 from its parts' crc32s equals zlib's
over the joined bytes."""

import random
import zlib

from meshtrain.services.checkpoint.crc import checksum, crc32_combine


def test_combined_crc_equals_crc_of_the_concatenation():
    rng = random.Random(0)
    for _ in range(50):
        parts = [
            rng.randbytes(rng.choice([0, 1, 7, 16, 4096, 100_003]))
            for _ in range(rng.randint(1, 6))
        ]
        crc = 0
        for part in parts:
            crc = crc32_combine(crc, checksum(part), len(part))
        assert crc == zlib.crc32(b"".join(parts))
