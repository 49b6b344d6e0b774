"""`echo-worker join` with what a new user mistypes: one line saying what to do, exit code 2, and
no join. Each was a traceback (a URL without http://, a port that is not a number; vllm asked
for where it is not installed, after the worker had joined; a CUDA device on a CPU build of
torch), found by a new user on 2026-12-07."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.main import url_problem

ROOT = Path(__file__).resolve().parents[3]


def join(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.main", "join", *args, "--config", "configs/worker.toml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_learner_url_is_checked_before_anything_else():
    for url in ("127.0.0.1:8650", "http://127.0.0.1:notaport", "http://127.0.0.1:99999", "ftp://x:1", "http://:80"):
        assert url_problem(url) is not None, url
    for url in ("http://127.0.0.1:8650", "https://learner.example.org", "http://[::1]:8650/"):
        assert url_problem(url) is None, url
    out = join("127.0.0.1:8650", "--token", "t" * 16)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "must look like http://HOST:PORT" in out.stderr and "no http://" in out.stderr


@pytest.mark.parametrize("override, says", [
    (("--engine.type", "vllm"), "make vllm-venv"),
    (("--engine.device", "cuda"), "sees no CUDA GPU"),
])
def test_an_engine_this_machine_cannot_run_is_said_before_joining(override, says):
    if override[1] == "vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    if override[1] == "cuda" and torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    # No learner listens at port 9: had it tried to join first, it would say it cannot reach it.
    out = join("http://127.0.0.1:9", "--token", "t" * 16, *override)
    assert out.returncode == 2 and "Traceback" not in out.stderr and says in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
