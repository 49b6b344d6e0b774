"""`echo-worker doctor` on this (CPU) machine against a real learner on loopback."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from conftest import ROOT, WATCHED


def doctors(*runs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`echo-worker doctor` with each of `runs`' arguments, all at once (each start-up is seconds)."""
    procs = [subprocess.Popen([sys.executable, "-m", "worker.main", "doctor", *args, "--min-disk-gb", "0.1"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=WATCHED) for args in runs]
    done = []
    for proc, args in zip(procs, runs):
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_doctor_passes_on_a_cpu_machine_says_there_is_no_gpu_and_fails_plainly_on_a_wrong_token_or_no_learner(learner_factory):
    lp = learner_factory(run={"steps": 1000})
    from scheduler.providers import machine_token

    key = (lp.run_dir / "machine.key").read_text().strip()
    for out in doctors((lp.url, "--token", lp.token), (lp.url, "--token", machine_token(key, "vast-1"))):
        # the run token, or a provider's machine token
        lines = out.stdout.splitlines()
        assert out.returncode == 0, out.stdout + out.stderr
        names = [line.split()[1] for line in lines[:-1]]
        assert names == ["gpu", "engine", "disk", "learner", "download", "clock", "generate"]
        assert lines[-1] == "echo-worker doctor: PASS"
        status = {line.split()[1]: line.split()[0] for line in lines[:-1]}
        gpu = next(line for line in lines if line.split()[1] == "gpu")
        if "no GPU" in gpu:
            assert status["gpu"] == "SKIP"
        assert all(status[n] == "PASS" for n in ("engine", "disk", "learner", "download", "clock", "generate")), lines
        assert "round trip" in lines[3] and "skew" in lines[5]
        assert "too small to measure the link" in lines[4]  # a few KB of config and tokenizer: no rate
    # Neither token was refused anywhere: a machine token is not the operator's, and its round trips
    # to /v1/status were five refusals a run, a fifth of its address's budget and 5 s late each.
    with urllib.request.urlopen(f"{lp.url}/metrics", timeout=10) as resp:  # loopback: no token needed
        metrics = resp.read().decode()
    assert not [line for line in metrics.splitlines() if line.startswith("echo_auth_refused_total{")], metrics
    # ...and fails plainly on a wrong token or no learner.
    out, nobody = doctors((lp.url, "--token", "wrong"), ("http://127.0.0.1:9", "--token", "x"))  # nothing listens on 9
    assert out.returncode == 1 and "FAIL download" in out.stdout and "check --token" in out.stdout
    assert out.stdout.splitlines()[-1] == "echo-worker doctor: FAIL (download)"
    out = nobody
    assert out.returncode == 1 and "FAIL learner   cannot reach" in out.stdout
