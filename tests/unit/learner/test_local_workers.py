"""The workers `[workers] spawn` starts beside the learner."""

from learner.config import WorkersSection
from learner.local_workers import LocalWorkers


def test_a_spawned_worker_gets_the_run_token_in_its_environment_not_on_its_command_line(tmp_path):
    """Any local user reads a command line (`ps`): `--token=<run token>` was on every spawned
    worker's (an API-only tester, 2026-11-30); the machine tokens of the local provider already
    went in the environment."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\necho "$ECHO_TOKEN" > {tmp_path}/token\n')
    fake.chmod(0o755)
    workers = LocalWorkers(WorkersSection(spawn=1, python=str(fake)), tmp_path / "logs", "the-run-token-0123456789", 0)
    workers.spawn("http://127.0.0.1:1")
    assert workers.procs[0].wait(10) == 0
    argv = (tmp_path / "argv").read_text()
    assert "join http://127.0.0.1:1" in argv and "the-run-token" not in argv
    assert (tmp_path / "token").read_text().strip() == "the-run-token-0123456789"
