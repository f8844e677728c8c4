"""Temporary outputs named for their host and process, and the removal of those whose process
died: a checkpoint export's `DST.tmp-*` folder (services/checkpoint/hf/convert.py), a preprocess's
`PREFIX.bin.tmp-*` / `PREFIX.idx.tmp-*` files (services/dataloader/indexed.py). Each is built
under such a name and renamed into place; one killed before the rename (SIGKILL, out of
memory) is removed by the next build of the same path instead of staying forever.

    tmp = local_build_dir(path)          # PATH.tmp-HOST-PID-HEX32
    removed = remove_dead_builds(path)   # those of dead processes on this host
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import uuid


def local_build_dir(path: str) -> str:
    """A fresh local name beside `path` to build it in (a folder or a file), then rename into place.

    The name holds this host and process id, so `remove_dead_builds` can tell the output of a
    build that was killed (SIGKILL, out of memory) from one still running.
    """
    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"


def remove_dead_builds(path: str) -> list[str]:
    """Removes the `local_build_dir`s of `path` (folders or files) whose process, on this host, is
    gone.

    Builds of live processes, of other hosts (a shared disk), and names of any other form are
    left alone.

    Returns:
        The paths removed.
    """
    removed = []
    host = socket.gethostname()
    for found in glob.glob(glob.escape(path) + ".tmp-*"):
        match = re.fullmatch(r"(.*)-(\d+)-[0-9a-f]{32}", found[len(path) + len(".tmp-") :])
        if match is None or match.group(1) != host:
            continue
        try:
            os.kill(int(match.group(2)), 0)
            continue  # alive (or the pid was reused): not ours to remove
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        if os.path.isdir(found) and not os.path.islink(found):
            shutil.rmtree(found, ignore_errors=True)
        else:
            try:
                os.remove(found)
            except FileNotFoundError:
                continue  # removed meanwhile by another build of the same path
        removed.append(found)
    return removed
