"""Loading onto a device mesh (8 fake CPU devices in a child process): each parameter lands sharded by its
logical axes, logits match the unsharded model, and export from the sharded model is bitwise the source."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="builds its checkpoint with transformers (pip install -e '.[dev]')")

REPO = Path(__file__).resolve().parents[2]


def test_sharded_load_forward_export(hf_checkpoints, tmp_path):
    import numpy as np
    from model_testlib import hf_logits
    from safetensors import safe_open

    hf, src = hf_checkpoints("qwen3_moe")
    ids = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
    np.savez(tmp_path / "inputs.npz", ids=ids, logits=hf_logits(hf, ids))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "mesh_worker.py"), str(src),
                           str(tmp_path / "out"), str(tmp_path / "inputs.npz")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    specs, shapes = res["specs"], res["shard_shapes"]
    # Rules: embed -> fsdp, kv_heads/expert_mlp/vocab -> tensor, heads/mlp -> (tensor, fsdp) (fsdp where embed left
    # it: the output projections' leading dimension), expert -> expert.
    assert specs["layers.0.attn.q_proj.kernel"] == ["fsdp", "tensor", None]
    assert shapes["layers.0.attn.q_proj.kernel"] == [32, 2, 16]
    assert specs["layers.0.mlp.experts.gate_proj"] == ["expert", "fsdp", "tensor"]
    assert shapes["layers.0.mlp.experts.gate_proj"] == [4, 32, 16]
    assert specs["layers.1.mlp.down_proj.kernel"] == [["tensor", "fsdp"], None]
    assert specs["embed.embedding"] == ["tensor", "fsdp"]
    assert specs["final_norm.scale"] == [None]
    assert res["max_diff"] <= 1e-4  # against transformers
    assert res["random_specs"] == specs and 0.015 < res["random_std"] < 0.025
    for f in ("model.safetensors",):
        with safe_open(str(src / f), "np") as a, safe_open(str(tmp_path / "out" / f), "np") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for k in a.keys():
                assert a.get_tensor(k).tobytes() == b.get_tensor(k).tobytes(), k
