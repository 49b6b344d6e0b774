"""docker/worker.Dockerfile: its shape (fast), and its install steps run in a fresh venv (slow:
a fresh venv installs torch and transformers, minutes; `make test-slow`). No Docker here: the
base image's python is stood in for by the venv's, vLLM (from the base image) is not installed,
so the image's last step, `echo-worker doctor`, runs the transformers engine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import venv

import pytest

from conftest import ROOT

DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_worker_image_is_vllm_with_echo_and_joins_by_default():
    steps = instructions()
    assert steps[0][0] == "FROM" and steps[0][1].startswith("vllm/vllm-openai:")
    assert ("ENTRYPOINT", '["echo-worker", "join"]') in steps
    copied = [s.split()[0] for op, s in steps if op == "COPY"]
    assert all((ROOT / c).exists() for c in copied), copied
    assert {"echo", "worker", "broadcast", "configs", "pyproject.toml"} <= set(copied)
    runs = [s for op, s in steps if op == "RUN"]
    assert any("pip install" in r and r.rstrip().endswith("-e .") for r in runs)
    assert runs[-1].startswith("echo-worker doctor")


@pytest.mark.slow
def test_the_dockerfile_install_steps_work_in_a_fresh_venv(tmp_path):
    work = tmp_path / "opt-echo"
    work.mkdir()
    for op, arg in instructions():
        if op == "COPY":
            *srcs, dst = arg.split()
            for src in srcs:
                target = work / dst / src if dst.endswith("/") else work / dst
                (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(ROOT / src, target)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    bin_dir = env_dir / "bin"
    (bin_dir / "python3").exists() or os.symlink(bin_dir / "python", bin_dir / "python3")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    env.pop("PYTHONPATH", None)
    for op, arg in instructions():
        if op != "RUN":
            continue
        done = subprocess.run(["bash", "-c", arg], cwd=work, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"RUN {arg}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert (bin_dir / "echo-worker").exists()
    assert "echo-worker doctor: PASS" in done.stdout, done.stdout
