"""The durable experience queue between explorer and trainer processes, the same suite on both backends (an SQLite
file, and a real PostgreSQL server started for the session): groups round-trip intact and in order, stale ones are
skipped and counted, a trainer that restarts from a checkpoint gets exactly the groups its checkpoint had not
trained on; with real processes: concurrent writers lose nothing, a writer killed with SIGKILL mid-run leaves only
whole batches, and a consumer killed with SIGKILL and restarted from its checkpoint consumes every group once."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import child_processes
import numpy as np
import pytest


from jrl.explore.queue import ExperienceGroup, QueueCounts, open_queue

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def _postgres_bin() -> Path | None:
    """The directory of PostgreSQL's server programs (Debian keeps them off PATH), or None."""
    found = shutil.which("pg_ctl") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))[-1:]), None)
    return Path(found).parent if found else None


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of this test session on a free port (as the ``postgres`` user when run as root, which
    the server refuses to run as); its base URL."""
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("needs PostgreSQL's server programs (apt-get install postgresql; .ci/run installs them)")
    root = Path(tempfile.mkdtemp(prefix="jrl-postgres-"))  # pytest's tmp tree is closed to other users
    data, port = root / "data", child_processes.free_port()
    run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if run_as:
        shutil.chown(root, "postgres")
    user = "postgres" if run_as else os.environ.get("USER", "postgres")

    def pg(*args: str) -> None:
        subprocess.run(run_as + [str(bindir / args[0]), *args[1:]], check=True, capture_output=True, timeout=120)

    pg("initdb", "-D", str(data), "-U", user, "--auth=trust")
    pg("pg_ctl", "-D", str(data), "-l", str(root / "server.log"), "-w", "-t", "60",
       "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start")
    try:
        yield f"postgresql://{user}@127.0.0.1:{port}/postgres"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    """A new, empty queue on each backend (PostgreSQL: a table of its own in the session's server)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/q/queue.db"
    return f"{request.getfixturevalue('postgres')}?table=q_{uuid.uuid4().hex[:12]}"


def _group(rng: np.random.Generator, version: int, index: int) -> ExperienceGroup:
    g, t = 3, int(rng.integers(2, 9))
    return ExperienceGroup(
        prompt_ids=rng.integers(0, 300, int(rng.integers(1, 7)), dtype=np.int32),
        completion_ids=rng.integers(0, 300, (g, t), dtype=np.int32),
        completion_mask=(rng.random((g, t)) < 0.8).astype(np.int32),
        sampling_logprobs=-rng.random((g, t)).astype(np.float32),
        truncated=rng.random(g) < 0.5, rewards=np.where(rng.random((g, 2)) < 0.2, np.nan, rng.random((g, 2))
                                                        ).astype(np.float32),
        policy_version=version, explorer=f"explorer-{index % 2}", prompt_index=index, reward_names=("right", "short"))


def _same(a: ExperienceGroup, b: ExperienceGroup) -> bool:
    arrays = all(np.array_equal(getattr(a, k), getattr(b, k), equal_nan=k == "rewards")
                 and getattr(a, k).dtype == getattr(b, k).dtype for k in ExperienceGroup._ARRAYS)
    fields = ("policy_version", "explorer", "prompt_index", "reward_names")
    return arrays and all(getattr(a, k) == getattr(b, k) for k in fields)


def test_groups_round_trip_in_order_and_stale_ones_are_skipped(url):
    rng = np.random.default_rng(0)
    groups = [_group(rng, version=v, index=i) for i, v in enumerate([0, 1, 0, 2, 2, 3, 1, 3])]
    queue = open_queue(url)
    queue.put(groups[:5])
    queue.put(groups[5:])
    first = queue.take(3, step=1)
    assert all(_same(a, b) for a, b in zip(first, groups[:3], strict=True))
    assert len({g.group_id for g in first}) == 3 and min(g.group_id for g in first) >= 0
    # min_version 2: groups 4.. of versions 0 and 1 (indices 6) are stale, never handed out.
    second = queue.take(3, step=2, min_version=2)
    assert [g.prompt_index for g in second] == [3, 4, 5]
    assert queue.counts() == QueueCounts(available=1, consumed=6, stale=1)
    with pytest.raises(TimeoutError, match=r"step 3 needs 2 groups of policy version 2\.\.3, 1 arrived"):
        queue.take(2, step=3, min_version=2, max_version=3, timeout=0.0)
    # max_version 2: the group of version 3 (index 7) is newer than the trainer: stale too.
    with pytest.raises(TimeoutError, match=r"1 groups of policy version 2\.\.2, 0 arrived"):
        queue.take(1, step=3, min_version=2, max_version=2, timeout=0.0)
    assert queue.counts() == QueueCounts(available=0, consumed=6, stale=2)
    # explorer-0 wrote indices 0, 2, 4, 6 and explorer-1 the others, whatever became of them
    assert (queue.written_by("explorer-0"), queue.written_by("explorer-1"), queue.written_by("x")) == (4, 4, 0)
    queue.close()


def test_rollback_hands_out_again_what_the_checkpoint_did_not_train_on(url):
    rng = np.random.default_rng(1)
    queue = open_queue(url)
    queue.put([_group(rng, version=0, index=i) for i in range(8)])
    taken = {step: [g.prompt_index for g in queue.take(2, step=step)] for step in (1, 2, 3)}
    assert queue.rollback_after(1) == 4  # steps 2 and 3 were after the checkpoint
    assert [g.prompt_index for g in queue.take(4, step=2)] == taken[2] + taken[3]
    assert queue.counts() == QueueCounts(available=2, consumed=6, stale=0)


def test_unknown_scheme_and_missing_path_are_named():
    with pytest.raises(KeyError, match=r"unknown experience queue 'redis'.*registered: 'postgresql', 'sqlite'"):
        open_queue("redis://localhost:6379/0")
    with pytest.raises(ValueError, match=r"has no scheme; use e.g. sqlite:///"):
        open_queue("runs/queue.db")


def _worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "queue_worker.py"), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


def test_concurrent_writers_lose_nothing(url):
    writers = [_worker("write", url, name, "20", "5") for name in ("a", "b")]
    for w in writers:
        _finish(w)
    queue = open_queue(url)
    assert queue.counts() == QueueCounts(available=200, consumed=0, stale=0)
    got = queue.take(200, step=1)
    for name in ("a", "b"):
        assert sorted(g.prompt_index for g in got if g.explorer == name) == list(range(100))
    assert all(int(g.completion_ids[0, 0]) == g.prompt_index for g in got)  # payloads intact


def test_a_writer_killed_mid_run_leaves_only_whole_batches(url):
    size = 50
    writer = _worker("write", url, "a", "0", str(size))
    for line in writer.stdout:  # let it commit three batches, then kill it while it writes on
        if line.strip() == "committed 2":
            break
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    queue = open_queue(url)
    available = queue.counts().available
    assert available % size == 0 and available >= 3 * size
    assert sorted(g.prompt_index for g in queue.take(available, step=1)) == list(range(available))


def test_a_consumer_killed_and_restarted_from_its_checkpoint_consumes_each_group_once(url, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    _finish(_worker("write", url, "a", "8", "3"))  # 24 groups: 8 steps of 3
    consumer = _worker("consume", url, "1", "8", "3", str(checkpoint))
    consumed: dict[int, list[int]] = {}
    for line in consumer.stdout:
        _, step, *indices = line.split()
        consumed[int(step)] = [int(i) for i in indices]
        if int(step) == 3:  # killed after step 3 (its checkpoint is of step 2)
            break
    consumer.send_signal(signal.SIGKILL)
    consumer.wait()
    resume = int(checkpoint.read_text())
    assert resume == 2
    queue = open_queue(url)
    assert queue.rollback_after(resume) >= 3  # step 3's groups (and step 4's, if it had started)
    trained = [i for step in range(1, resume + 1) for i in consumed[step]]
    for line in _finish(_worker("consume", url, str(resume + 1), str(8 - resume), "3", str(checkpoint))).split("\n"):
        if line:
            trained += [int(i) for i in line.split()[2:]]
    assert sorted(trained) == list(range(24))  # every group once: none lost, none twice
    assert queue.counts() == QueueCounts(available=0, consumed=24, stale=0)
