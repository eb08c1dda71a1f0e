"""GRPO and EBFT structured mode end to end against a real vLLM server: LoRA runs on the tiny default model
with the ``vllm`` backend and adapter sync after every step (the GRPO run also prefetches one rollout
batch). The served adapter version follows the steps, metrics.jsonl has sync timings, the sampler-correction
stats and (EBFT) the feature-matching metrics, and every wait is bounded by the config's timeouts. The runs
share the suite's server (each trainer's adapters carry its own tag)."""

from __future__ import annotations

import dataclasses
import json
import math

import child_processes as helpers
import pytest
from vllm_testlib import TINY_MODEL, logprob_tolerance

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.models.lora import LoraConfig
from jrl.rollout.vllm_engine import VLLMRolloutEngine
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, TrainConfig
from jrl.train.ebft_config import EBFTConfig
from jrl.rewards.functions import RewardSpec

pytestmark = pytest.mark.vllm

STEPS = 5
EBFT_STEPS = 3
#: A reward that differs between almost any two completions (a hash of the token ids), so every step has a
#: learning signal and makes a real update.
REWARD = """
def id_hash(prompts, completions, completion_ids, **kw):
    return [(sum(ids) % 7) / 6 for ids in completion_ids]
"""


@pytest.fixture(scope="module")
def e2e_server(vllm_server):
    """The suite's vLLM server, reached with the longer timeouts of a training run."""
    return dataclasses.replace(vllm_server.config, read_timeout=120.0, restart_timeout=120.0)


def _run(cfg: TrainConfig):
    """Train ``cfg`` to the end; (the trainer's engine, the model names the server serves, metrics.jsonl rows)."""
    from jrl.train.trainer import Trainer

    trainer = Trainer(cfg, progress=False)
    try:
        trainer.train()
        engine = trainer.engine
        served = {m["id"] for m in engine.client.get("/v1/models")["data"]}
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (trainer.out_dir / "metrics.jsonl").read_text().splitlines()]
    return engine, served, rows


def _check_adapter_sync(engine, served, out_dir, steps: int, rows) -> None:
    """The adapter served follows the trainer: synced after every step, the last sync is version ``steps``
    and the one before it is kept (on the server and on disk)."""
    assert engine.version == steps and engine.current_name == engine.adapter_name(steps)
    assert {n for n in served if n.startswith(engine.tag)} == {engine.adapter_name(steps - 1),
                                                               engine.adapter_name(steps)}
    assert sorted(p.name for p in (out_dir / "vllm_sync").iterdir()) == [f"lora-v{steps - 1}", f"lora-v{steps}"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["sync/version"] == r["step"], r
        assert r["time/sync"] > 0 and math.isfinite(r["time/sync"]), r
        for key in ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean"):
            assert math.isfinite(r[key]), (key, r)
        assert r["sampling/frac_missing_logprobs"] == 0.0


def test_grpo_with_vllm_lora_sync_and_prefetch(e2e_server, tmp_path):
    reward = tmp_path / "id_hash_reward.py"
    reward.write_text(REWARD)
    cfg = TrainConfig(
        model=ModelSpec(path=str(TINY_MODEL)), lora=LoraConfig(rank=8, alpha=16.0),
        data=DataConfig(source="builtin:arithmetic", prompts_per_batch=2, max_prompt_length=64, seed=0),
        rollout=RolloutConfig(backend="vllm", sync="lora", vllm=e2e_server, max_new_tokens=12, temperature=1.0,
                              prefetch_depth=1, max_staleness=1, sync_interval=1),
        rewards=(RewardSpec(path=f"{reward}:id_hash"),),
        algo=GRPOConfig(num_generations=4, loss_type="dapo"),
        optim=OptimConfig(learning_rate=5e-3), max_steps=STEPS, save_every=0, output_dir=str(tmp_path / "run"),
        seed=0)
    engine, served, rows = _run(cfg)
    _check_adapter_sync(engine, served, tmp_path / "run", STEPS, rows)
    for r in rows:
        assert r["skipped_zero_adv_batches"] == 0
        assert 0 <= r["async/staleness"] <= 1
    assert any(r["async/staleness"] == 1 for r in rows)  # generation really ran one step ahead
    # The server generates apart from the learner: each later step was taken, scored and launched during the update
    # before it (the adapter sync between them reads the weights of that update).
    assert [r["async/experience_ahead"] for r in rows] == [0] + [1] * (STEPS - 1)


@pytest.mark.slow  # 22 s; the GRPO run above covers the LoRA sync to a real server
def test_ebft_structured_with_vllm_lora_sync(e2e_server, tmp_path):
    """EBFT structured mode on the vLLM backend: the server samples within the batch's adaptive generation
    limit, the frozen LoRA base scores the completions against the ``solution`` column in (group-whitened)
    feature space, and the adapter is synced to the server after every step."""
    # The shipped EBFT config's feature settings; the arithmetic solutions are 18-19 tokens, so with
    # multiplier 1 the adaptive limit stays below the static completion length of 24.
    ebft = EBFTConfig(feature_layers=(0.5, 1.0), embed_method="last_token", use_whitening=True,
                      whitening_scope="group", diversity_coef=0.0, gt_length_multiplier=1.0, adaptive_min_tokens=4,
                      gt_column="solution")
    cfg = TrainConfig(
        model=ModelSpec(path=str(TINY_MODEL)), lora=LoraConfig(rank=8, alpha=16.0),
        data=DataConfig(source="builtin:arithmetic", prompts_per_batch=2, max_prompt_length=64, seed=0),
        rollout=RolloutConfig(backend="vllm", sync="lora", vllm=e2e_server, max_new_tokens=24, temperature=1.0,
                              sync_interval=1),
        algorithm="ebft_structured", ebft=ebft, algo=GRPOConfig(num_generations=4, loss_type="grpo"),
        optim=OptimConfig(learning_rate=5e-3), max_steps=EBFT_STEPS, save_every=0,
        output_dir=str(tmp_path / "run"), seed=0)
    engine, served, rows = _run(cfg)
    assert isinstance(engine, VLLMRolloutEngine)
    _check_adapter_sync(engine, served, tmp_path / "run", EBFT_STEPS, rows)
    for r in rows:
        for key in ("ebft/alignment", "ebft/cfm_loss", "ebft/reward"):
            assert math.isfinite(r[key]), (key, r)
        assert -2.0 <= r["ebft/alignment"] <= 2.0 and r["ebft/cfm_loss"] >= 0.0, r  # 2·cos, a squared norm
        # The server kept to the adaptive limit, which is below the static completion length.
        assert r["completions/max_length"] <= r["ebft/max_new_tokens"] < cfg.rollout.max_new_tokens, r
        assert r["skipped_zero_adv_batches"] == 0 and r["grad_norm"] > 0, r  # every step changes the adapter
        # No prefetch: each batch is sampled right after the previous step's sync, so the server's
        # log-probs are the trainer's own under the adapter it just trained.
        assert r["async/staleness"] == 0, r
        assert r["sampling/sampling_logp_difference/mean"] <= logprob_tolerance(e2e_server.dtype), r


#: A LoRA GRPO run on the vLLM backend as a config file (``scripts/train.py --config``); ``{vllm}`` and ``{reward}``
#: are filled in by the test.
MULTIPROCESS_CONFIG = """
from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.models.lora import LoraConfig
from jrl.rollout.vllm_config import VLLMConfig
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, TrainConfig
from jrl.rewards.functions import RewardSpec


def config():
    return TrainConfig(
        model=ModelSpec(path={model!r}), lora=LoraConfig(rank=8, alpha=16.0),
        data=DataConfig(source="builtin:arithmetic", prompts_per_batch=2, max_prompt_length=64, seed=0),
        rollout=RolloutConfig(backend="vllm", sync="lora", vllm=VLLMConfig(**{vllm!r}), max_new_tokens=12),
        rewards=(RewardSpec(path={reward!r}),), algo=GRPOConfig(num_generations=4, loss_type="dapo"),
        optim=OptimConfig(learning_rate=5e-3), max_steps=3, save_every=0, output_dir="unused", seed=0)
"""


# 67 s beside a second test process (2-core CPU); the default suite keeps the one-process vLLM run above and the
# leader engine's processes (tests/rollout/test_leader_engine.py)
@pytest.mark.slow
def test_two_trainer_processes_share_one_driver_of_the_server(e2e_server, tmp_path):
    """scripts/train.py as 2 processes x 1 CPU device on the vLLM backend: process 0 drives the server (one adapter
    per version, written once), both train on the same completions (the sampler-trainer logprob agreement holds for
    the rows of each process), one metrics.jsonl."""
    import subprocess
    import sys


    reward = tmp_path / "id_hash_reward.py"
    reward.write_text(REWARD)
    config = tmp_path / "config.py"
    config.write_text(MULTIPROCESS_CONFIG.format(model=str(TINY_MODEL), vllm=dataclasses.asdict(e2e_server),
                                                 reward=f"{reward}:id_hash"))
    port, out = helpers.free_port(), tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "scripts/train.py", "--config", str(config), "--output-dir", str(out)],
                              env=helpers.worker_env(1, JRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                     JRL_NUM_PROCESSES="2", JRL_PROCESS_ID=str(i)),
                              cwd=helpers.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (stdout, stderr, rc) in enumerate(results):
        assert rc == 0, f"process {i} exited {rc}\n{stdout[-2000:]}\n{stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    tolerance = logprob_tolerance(e2e_server.dtype)
    for r in rows:
        assert r["sync/version"] == r["step"]
        # Process 1's rows are half the batch: wrong tokens or logprobs there would break the agreement.
        assert abs(r["sampling/sampling_logp_difference/mean"]) <= tolerance, r
        assert r["sampling/frac_missing_logprobs"] == 0.0 and r["grad_norm"] > 0, r
    assert sorted(p.name for p in (out / "vllm_sync").iterdir()) == ["lora-v2", "lora-v3"]


def test_an_explorer_samples_with_the_published_adapter_on_its_vllm_server(e2e_server, tmp_path):
    """``mode='train'`` here, and an explorer (``mode='explore'``, in a thread) whose rollouts come from the vLLM
    server: with ``max_staleness`` 0 every step trains on groups the server sampled with the adapter the trainer
    published after the previous step, so the server's log-probs agree with the trainer's own."""
    import threading

    from jrl.train.exploration import explore
    from jrl.explore.config import ExploreConfig
    from jrl.train.trainer import Trainer

    reward = tmp_path / "id_hash_reward.py"
    reward.write_text(REWARD)
    cfg = TrainConfig(
        mode="train", model=ModelSpec(path=str(TINY_MODEL)), lora=LoraConfig(rank=8, alpha=16.0),
        data=DataConfig(source="builtin:arithmetic", prompts_per_batch=2, max_prompt_length=64, seed=0),
        rollout=RolloutConfig(backend="vllm", sync="lora", vllm=e2e_server, max_new_tokens=12, max_staleness=0),
        rewards=(RewardSpec(path=f"{reward}:id_hash"),), algo=GRPOConfig(num_generations=4, loss_type="dapo"),
        optim=OptimConfig(learning_rate=5e-3), max_steps=3, save_every=0, output_dir=str(tmp_path / "run"),
        explore=ExploreConfig(name="v", timeout_s=120.0))
    errors = []

    def explorer():
        try:
            explore(dataclasses.replace(cfg, mode="explore"))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=explorer)
    thread.start()
    trainer = Trainer(cfg, progress=False)
    try:
        rows = trainer.train()
    finally:
        trainer.close()
        thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["async/staleness"] == 0 and r["explore/v/groups"] == 2, r
        assert r["sampling/frac_missing_logprobs"] == 0.0 and r["grad_norm"] > 0, r
        assert abs(r["sampling/sampling_logp_difference/mean"]) <= logprob_tolerance(e2e_server.dtype), r
    log = [json.loads(x) for x in (tmp_path / "run" / "explorers" / "v" / "metrics.jsonl").read_text().splitlines()]
    assert {m["explorer/version"] for m in log} >= {0.0, 1.0, 2.0}
