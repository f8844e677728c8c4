"""Data workers share the load: ranks spread over the live workers, found through a `dir:`
folder workers announce themselves in, and move as workers join and die, without a sample
dropped or repeated (every batch compared with the in-process loader's)."""

import signal
import threading
import time

import pytest

from meshtrain.services.common.errors import ConfigError, DataError
from meshtrain.services.dataloader.loader import LocalBatchSource
from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.rpc.discovery import announce, announced, resolve_workers
from meshtrain.services.dataloader.spec import open_dataset
from tests.services.dataloader.conftest import WorkerProcess, batch_hash

pytestmark = pytest.mark.e2e


def _hashes(batches):
    return [batch_hash(b) for b in batches]


def test_announce_writes_one_address_and_withdraws_it(tmp_path):
    folder = tmp_path / "workers"
    with announce(folder, "node7:7001"), announce(folder, "[::1]:7002"):
        (folder / "notes.txt").write_text("not a worker")
        (folder / "junk.worker").write_text("rm -rf /")  # not an address: skipped
        assert resolve_workers(f"dir:{folder}") == ["[::1]:7002", "node7:7001"]
    assert announced(folder) == []
    assert resolve_workers(f"dir:{tmp_path / 'nobody-yet'}") == []


def test_announce_refuses_what_is_not_an_address(tmp_path):
    with pytest.raises(DataError, match="cannot announce 'no port'"), announce(tmp_path, "no port"):
        pass


def test_the_data_config_names_a_malformed_target():
    from meshtrain.services.dataloader.config import DataConfig

    with pytest.raises(
        ConfigError, match="data.service_addresses: .*'dns:///x' must be dns:///name:port"
    ):
        DataConfig(service_addresses=["dns:///x"])
    with pytest.raises(ConfigError, match="data.service_rebalance_s=-1"):
        DataConfig(service_rebalance_s=-1)


def test_ranks_spread_evenly_over_the_workers(blend_spec):
    workers = [WorkerProcess().wait_ready() for _ in range(2)]
    try:
        addresses = [w.address for w in workers]
        sources = [
            ServiceBatchSource(addresses, blend_spec, 1, 16, r, 4, give_up_s=20) for r in range(4)
        ]
        try:
            for r, src in enumerate(sources):
                local = LocalBatchSource(open_dataset(blend_spec), 1, 16, r, 4)
                assert _hashes(src.micro_batches(0)) == _hashes(local.micro_batches(0))
            assert [s.current_address for s in sources] == [addresses[r % 2] for r in range(4)]
        finally:
            for s in sources:
                s.close()
    finally:
        for w in workers:
            w.stop()


def test_a_joining_worker_takes_its_share_and_a_killed_one_loses_no_sample(long_spec, tmp_path):
    """Two ranks stream from one announced worker; a second announces itself mid-run and the
    rank whose slot falls on it moves there; then the first is SIGKILLed (its announcement
    stays behind) and its rank fails over. Both ranks' streams equal the in-process ones."""
    folder = tmp_path / "workers"
    first = WorkerProcess(args=("--announce", str(folder))).wait_ready()
    second = None
    sources = [
        ServiceBatchSource(
            [f"dir:{folder}"],
            long_spec,
            2,
            16,
            r,
            2,
            prefetch=2,
            rebalance_s=0.2,
            backoff_s=(0.01, 0.1),
            give_up_s=30,
            bench_s=60,
        )
        for r in range(2)
    ]
    got = [[], []]
    try:

        def step_both():
            for r, src in enumerate(sources):
                got[r].append(_hashes(src.micro_batches(len(got[r]))))

        for _ in range(3):
            step_both()
        assert {s.current_address for s in sources} == {first.address}
        second = WorkerProcess(args=("--announce", str(folder))).wait_ready()
        assert sorted(announced(folder)) == sorted([first.address, second.address])
        ordered = sorted([first.address, second.address])
        _wait_stepping(
            lambda: (
                sources[1].current_address == ordered[1]
                and sources[0].current_address == ordered[0]
            ),
            step_both,
            "rank 1 to move to its slot's worker",
        )
        moved = [s.moves for s in sources]
        assert sum(moved) >= 1 and all(s.reconnects == 0 for s in sources)
        on_first = next(s for s in sources if s.current_address == first.address)
        first.kill()  # SIGKILL: its announcement is left behind
        _wait_stepping(
            lambda: on_first.reconnects >= 1 and on_first.current_address == second.address,
            step_both,
            "the rank on the killed worker to fail over",
        )
        for _ in range(3):
            step_both()
        assert first.address in announced(folder)  # still named, but benched
    finally:
        for s in sources:
            s.close()
        first.stop()
        if second is not None:
            second.stop()
    for r in range(2):
        local = LocalBatchSource(open_dataset(long_spec), 2, 16, r, 2)
        assert got[r] == [_hashes(local.micro_batches(s)) for s in range(len(got[r]))]


def _wait_stepping(cond, step, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        step()


def test_a_worker_withdraws_its_announcement_on_sigterm(tmp_path):
    folder = tmp_path / "workers"
    worker = WorkerProcess(
        args=("--announce", str(folder), "--advertise", "127.0.0.1")
    ).wait_ready()
    try:
        assert announced(folder) == [worker.address]
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(timeout=30) == 0
        assert announced(folder) == []
    finally:
        worker.stop()


def test_no_worker_announced_for_give_up_s_is_a_clear_error(blend_spec, tmp_path):
    src = ServiceBatchSource(
        [f"dir:{tmp_path / 'empty'}"], blend_spec, 2, 16, 0, 2, give_up_s=1.0, backoff_s=(0.05, 0.1)
    )
    with src, pytest.raises(DataError, match=r"no data worker is announced at .*empty"):
        src.micro_batches(0)


def test_a_worker_announced_late_is_found(blend_spec, tmp_path):
    """A rank started before any worker (a Slurm step still queued) streams once one announces."""
    folder = tmp_path / "workers"
    local = LocalBatchSource(open_dataset(blend_spec), 2, 16, 0, 2)
    worker = None
    with ServiceBatchSource(
        [f"dir:{folder}"], blend_spec, 2, 16, 0, 2, give_up_s=60, backoff_s=(0.05, 0.2)
    ) as src:
        result = {}
        reader = threading.Thread(
            target=lambda: result.setdefault("b", _hashes(src.micro_batches(0)))
        )
        reader.start()
        time.sleep(0.5)
        assert reader.is_alive()
        try:
            worker = WorkerProcess(args=("--announce", str(folder))).wait_ready()
            reader.join(timeout=60)
            assert result["b"] == _hashes(local.micro_batches(0))
        finally:
            if worker is not None:
                worker.stop()
