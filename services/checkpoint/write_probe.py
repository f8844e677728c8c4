"""Whether a checkpoint root takes a write now: deploy/train.sh asks before it starts training.

A root whose storage refuses every write (an object store without a writable volume, a
read-only or full disk, denied credentials) would let a run train up to its first save, fail
there and, started again by compose or Slurm, train the same steps again forever. The probe
writes a few bytes under the root, reads them back and removes them, and exits 0 when that
worked, else STORAGE_EXIT_STATUS (74, the status `meshtrain train` ends with when a save's
storage keeps failing) naming the root and the error:

    python -m meshtrain.services.checkpoint.write_probe s3://bucket/run/checkpoints
"""

from __future__ import annotations

import argparse
import secrets
import sys

from meshtrain.services.checkpoint.store import join, open_root, read_bytes
from meshtrain.services.common.errors import STORAGE_EXIT_STATUS


def probe(url: str) -> None:
    """Writes, reads back and removes a small object under the root `url`.

    Raises:
        Exception: what the storage raised (an OSError, a storage library's own error), or a
            CheckpointError for a root URL that cannot be opened.
    """
    root = open_root(url)
    # A dot-name: `ckpt list` and every reader look only at step folders.
    path = join(root.path, f".write-probe-{secrets.token_hex(6)}")
    data = secrets.token_bytes(64)
    if root.is_local:
        root.fs.makedirs(root.path, exist_ok=True)
    root.fs.pipe_file(path, data)
    try:
        if read_bytes(root, path) != data:
            raise OSError(f"{url}: the probe object read back differs from what was written")
    finally:
        root.fs.rm_file(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m meshtrain.services.checkpoint.write_probe",
        description="Exit 0 if the checkpoint root takes a write now, else "
        f"{STORAGE_EXIT_STATUS} naming the error.",
    )
    p.add_argument("root", help="checkpoint root: a folder or s3://bucket/prefix")
    args = p.parse_args(argv)
    try:
        probe(args.root)
    except Exception as e:  # noqa: BLE001 - any failure of the storage counts
        print(
            f"meshtrain: error: checkpoint storage failed: {args.root} takes no write: {e!r}",
            file=sys.stderr,
        )
        return STORAGE_EXIT_STATUS
    return 0


if __name__ == "__main__":
    sys.exit(main())
