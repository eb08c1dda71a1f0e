"""scripts/convert.py: the torch-free demo (the README's temporary main job) and the HF round-trip CLI."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "convert.py"


def test_demo_needs_no_torch():
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            f"sys.argv = ['convert.py', '--demo']; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |logit diff| 0 " in proc.stdout, proc.stdout
    assert "parameters" in proc.stdout and "model.safetensors.index.json" in proc.stdout


def test_cli_round_trip(hf_checkpoints, tmp_path, capsys):
    pytest.importorskip("torch")
    _, src = hf_checkpoints("qwen2")
    spec = importlib.util.spec_from_file_location("jrl_convert_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(src), str(tmp_path / "out"), "--dtype", "float32", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "model_type      qwen2" in out and "bitwise identical: True" in out
    with pytest.raises(SystemExit):
        mod.main([str(src)])
