"""The trainer as several processes: ``scripts/train.py --config configs/grpo.py`` run as 2 processes x 4 CPU devices
(``jax.distributed`` through the ``JRL_*`` variables, gloo collectives) against 1 process x 8 devices: the same
metrics, one metrics.jsonl, also with a rollout mesh of its own, with gradients summed per device over an update
and for an MoE model with expert parallelism beside FSDP, checkpoints that resume across process counts, a
stop signal to one process stopping both at one step boundary, a killed process taking its peer down with an
error naming it, the paged sampler and partial rollouts (carried rows' kept keys and values too) as in one process,
and what several processes cannot run (episodes) refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import child_processes as helpers
import pytest


REPO = Path(__file__).resolve().parents[2]
STEPS = 4
RUN = ["--config", "configs/grpo.py", "--max-steps", str(STEPS), "--save-every", "2", "--data.prompts-per-batch", "4",
       "--log-every", "1"]
TIMEOUT = 420
#: A peer's loss must end the surviving process within this many seconds.
LOST_PEER_S = 60

#: ``exact_match`` of the arithmetic task (same name, same rewards) that, on the process and at the call
#: ``JRL_TEST_SIGNAL=<SIGNAL>:<process>:<call>`` names, sends the signal to its trainer process (the parent of the
#: reward worker) after writing the time to the file ``JRL_TEST_SIGNALLED_AT`` names.
SIGNALLING_REWARD = '''
import os
import signal
import time

from jrl.data.tasks.arithmetic import exact_match as _exact_match

CALLS = 0


def exact_match(prompts, completions, **kw):
    global CALLS
    CALLS += 1
    name, process, call = (os.environ.get("JRL_TEST_SIGNAL") or "NONE:-1:-1").split(":")
    if os.environ.get("JRL_PROCESS_ID") == process and CALLS == int(call):
        with open(os.environ["JRL_TEST_SIGNALLED_AT"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getppid(), getattr(signal, "SIG" + name))
    return _exact_match(prompts, completions, **kw)
'''


def _launch(out: Path, processes: int, *extra: str, **env: str) -> list[subprocess.Popen]:
    """``scripts/train.py`` as ``processes`` processes of ``8 // processes`` CPU devices each, writing ``out``."""
    port = helpers.free_port()
    procs = []
    for i in range(processes):
        dist = {} if processes == 1 else dict(JRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                              JRL_NUM_PROCESSES=str(processes), JRL_PROCESS_ID=str(i))
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "train.py"), *RUN, "--output-dir", str(out), *extra],
            env=helpers.worker_env(8 // processes, **dist, **env), cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs: list[subprocess.Popen], *, check: bool = True) -> list[tuple[int, str, str, float]]:
    """(exit code, stdout, stderr, time it ended) of each process; with ``check`` a non-zero exit fails the test."""
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            results.append((p.returncode, stdout, stderr, time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if check:
        for i, (rc, stdout, stderr, _) in enumerate(results):
            assert rc == 0, f"process {i} exited {rc}\nstdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-30000:]}"
    return results


def _metrics(out: Path) -> list[dict]:
    """metrics.jsonl of ``out`` without the timing metrics."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_second"} for r in rows]


def _assert_close(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k, v in w.items():
            assert (g[k] is None) == (v is None), (g["step"], k, g[k], v)
            if v is not None:
                assert abs(g[k] - v) <= 1e-5 * max(abs(v), 1.0), (g["step"], k, g[k], v)


def _signalling_rewards(directory: Path) -> list[str]:
    """``--rewards`` with :data:`SIGNALLING_REWARD` (written to ``directory``) in place of ``exact_match``."""
    path = directory / "signalling_reward.py"
    path.write_text(SIGNALLING_REWARD)
    return ["--rewards", f"{path}:exact_match=1.0", "jrl.data.tasks.arithmetic:format_reward=0.5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1 x 8 reference and the 2 x 4 run of the same config, run side by side."""
    base = tmp_path_factory.mktemp("multiprocess")
    one, two = _launch(base / "one", 1), _launch(base / "two", 2)
    results = _wait(one + two)
    return base, results


def test_two_processes_train_like_one(runs):
    base, results = runs
    want = _metrics(base / "one")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert any(r["grad_norm"] > 0 for r in want) and any(r["reward/mean"] > 0 for r in want)
    _assert_close(_metrics(base / "two"), want)
    # Only process 0 writes the run's logs and prints its summary.
    main, other = results[1], results[2]
    assert "done: 4 steps logged" in main[1] and "done:" not in other[1]
    assert (base / "two" / "curves.png").is_file() and (base / "two" / "tensorboard").is_dir()
    assert sorted(int(p.name) for p in (base / "two" / "checkpoints").iterdir()) == [2, 4]


def test_a_rollout_mesh_of_its_own_trains_like_one_shared_mesh(runs, tmp_path):
    """2 processes x 4 devices, each giving 2 devices to the sampler's own mesh (the learner trains on the other 4,
    the weights are copied across processes' devices at each sync): the metrics of the 1 x 8 shared-mesh run."""
    base, _ = runs
    _wait(_launch(tmp_path / "run", 2, "--rollout.devices", "4"))
    _assert_close(_metrics(tmp_path / "run"), _metrics(base / "one"))


def test_gradients_summed_per_device_train_alike_in_two_processes(runs, tmp_path):
    """``--optim.grad-sync update`` with micro-batches of 8 rows (one per device): 2 processes x 4 devices give the
    metrics of 1 x 8, and the losses and gradient norms of the reference run (one micro-batch, reduced by XLA)."""
    base, _ = runs
    extra = ("--max-steps", "2", "--optim.micro-batch-size", "8", "--optim.grad-sync", "update")
    _wait(_launch(tmp_path / "one", 1, *extra) + _launch(tmp_path / "two", 2, *extra))
    _assert_close(_metrics(tmp_path / "two"), _metrics(tmp_path / "one"))
    keys = ("step", "loss", "grad_norm", "reward/mean")
    summed = [{k: r[k] for k in keys} for r in _metrics(tmp_path / "one")]
    assert [r["step"] for r in summed] == [1, 2]
    _assert_close(summed, [{k: r[k] for k in keys} for r in _metrics(base / "one")][:2])


def test_checkpoints_resume_across_process_counts(runs, tmp_path):
    """A checkpoint of the 2-process run resumes in 1 process, and the reverse, with the same next steps."""
    base, _ = runs
    want = _metrics(base / "one")
    for source in ("one", "two"):
        shutil.copytree(base / source, tmp_path / f"from_{source}")
    resumed = (_launch(tmp_path / "from_two", 1, "--resume", "--resume-from", "2")
               + _launch(tmp_path / "from_one", 2, "--resume", "--resume-from", "2"))
    _wait(resumed)
    for source in ("one", "two"):
        _assert_close(_metrics(tmp_path / f"from_{source}"), want)


def test_expert_parallelism_with_fsdp_across_processes_trains_alike(tmp_path):
    """A tiny Qwen3-MoE (4 experts) with its experts split within each process and FSDP across processes
    (``--mesh.expert 4 --mesh.fsdp 2``) as 2 processes x 4 devices: the metrics of 1 process x 8 devices in the same
    layout (the token gathers and reduce-scatters of the expert axis, the weights' FSDP over the processes)."""
    from train_testlib import save_tiny_model_dir, write_reward_file

    moe = save_tiny_model_dir(tmp_path / "moe", model_type="qwen3_moe", qk_norm=True, head_dim=8, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16)
    extra = ("--max-steps", "2", "--mesh.expert", "4", "--mesh.fsdp", "2", "--model.path", str(moe), "--rewards",
             f"{write_reward_file(tmp_path, 'reward_moe')}:low_ids=1.0")
    _wait(_launch(tmp_path / "one", 1, *extra) + _launch(tmp_path / "two", 2, *extra))
    want = _metrics(tmp_path / "one")
    assert [r["step"] for r in want] == [1, 2] and any(r["grad_norm"] > 0 for r in want)
    _assert_close(_metrics(tmp_path / "two"), want)


@pytest.mark.slow  # ~100 s beside a second test process (2-core CPU)
def test_a_signal_to_one_process_stops_both_after_one_step(runs, tmp_path):
    """SIGTERM reaches only process 1, in step 2: both finish step 2, write its checkpoint and exit 0; --resume
    reproduces the uninterrupted run."""
    base, _ = runs
    rewards = _signalling_rewards(tmp_path)
    out = tmp_path / "run"
    results = _wait(_launch(out, 2, *rewards, JRL_TEST_SIGNAL="TERM:1:2",
                            JRL_TEST_SIGNALLED_AT=str(tmp_path / "signalled_at")))
    assert (tmp_path / "signalled_at").is_file()
    assert [r["step"] for r in _metrics(out)] == [1, 2]
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [2]
    assert "SIGTERM received: stopped after step 2 of 4" in results[1][2]
    assert "done: 2 steps logged" in results[0][1]
    _wait(_launch(out, 2, *rewards, "--resume"))
    _assert_close(_metrics(out), _metrics(base / "one"))


def test_a_killed_process_ends_its_peer_with_an_error_naming_it(tmp_path):
    """SIGKILL to process 1 in step 2: process 0, waiting for it in a collective, exits 1 within seconds naming it
    (not after JAX's heartbeat timeout with a fatal abort)."""
    rewards = _signalling_rewards(tmp_path)
    results = _wait(_launch(tmp_path / "run", 2, *rewards, JRL_TEST_SIGNAL="KILL:1:2",
                            JRL_TEST_SIGNALLED_AT=str(tmp_path / "signalled_at")), check=False)
    killed_at = float((tmp_path / "signalled_at").read_text())
    (rc0, _, stderr0, ended0), (rc1, *_) = results
    assert rc1 == -9
    assert rc0 == 1, stderr0[-3000:]
    assert ended0 - killed_at < LOST_PEER_S, (ended0 - killed_at, stderr0[-3000:])
    assert "lost process 1 of 2" in stderr0 and "--resume" in stderr0, stderr0[-3000:]


def test_the_paged_sampler_and_partial_rollouts_across_processes_train_like_one(tmp_path):
    """``--rollout.kv.layout paged`` (each process decodes the prompts of its own devices, the rows gathered after)
    and partial rollouts (the stop test counts every process's finished groups) as 2 processes x 4 devices: the
    metrics of 1 process x 8 devices. The paged run's 4 groups take parts on process 0's devices only (process 1
    decodes nothing and still gathers); the partial runs' generations hold 8 groups, one per device, so both processes
    decode in rounds of 4 steps, so that a generation stops with rows running, and carry those by their kept keys and
    values (the default ``partial_kv='keep'``: each group goes back to the device, and so the process, that kept its
    rows; the generation after the checkpoint step prefills them) or by their tokens (``recompute``)."""
    paged = ("--max-steps", "3", "--rollout.kv.layout", "paged", "--rollout.kv.slots", "8")
    partial = paged + ("--rollout.partial", "--rollout.max-new-tokens", "24", "--rollout.kv.round-steps", "4")
    cases = (("paged", paged), ("partial", partial), ("recompute", partial + ("--rollout.partial-kv", "recompute")))
    runs = {(name, n): _launch(tmp_path / f"{name}{n}", n, *extra) for name, extra in cases for n in (1, 2)}
    _wait([p for procs in runs.values() for p in procs])
    for name, _ in cases:
        want = _metrics(tmp_path / f"{name}1")
        assert [r["step"] for r in want] == [1, 2, 3] and any(r["grad_norm"] > 0 for r in want), name
        _assert_close(_metrics(tmp_path / f"{name}2"), want)
    for name in ("partial", "recompute"):
        carried = [r["partial/tokens_from_earlier_steps"] for r in _metrics(tmp_path / f"{name}2")]
        assert any(c > 0 for c in carried), (name, carried)
    placed = [r.get("partial/kept_rows_placed", 0) for r in _metrics(tmp_path / "partial2")]
    assert any(p > 0 for p in placed), placed


def test_what_several_processes_cannot_run_is_refused_by_name(tmp_path):
    for rc, _, stderr, _ in _wait(_launch(tmp_path / "run", 2, "--env.name", "higher_lower"), check=False):
        assert rc == 2 and "env.name='higher_lower'" in stderr, stderr[-3000:]
