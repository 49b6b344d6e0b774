"""The run directory's files that other processes poll for."""

import threading

from echo.config import load_config
from learner.config import LearnerConfig
from learner.rundir import RunDir


def test_the_url_is_never_read_half_written(tmp_path):
    """Workers (and the tests) poll for RUN_DIR/url and join what it says: written in place, a
    reader caught it empty between the truncate and the write and joined "" (CI, 2026-11-27)."""
    cfg = load_config(LearnerConfig, None, ["--run.dir", str(tmp_path), "--server.token", "run-token-0123456789"])
    run_dir = RunDir(cfg)
    run_dir.create(cfg)
    url, seen, done = run_dir / "url", [], threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                seen.append(url.read_text())
            except FileNotFoundError:
                pass

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            run_dir.announce(f"http://127.0.0.1:{20000 + i % 2}")
    finally:
        done.set()
        reader.join()
    assert seen and all(text.startswith("http://127.0.0.1:2000") and text.endswith("\n") for text in seen)
    assert not (run_dir / "url.tmp").exists()


def test_resume_of_a_directory_that_is_no_run_says_so(tmp_path, capsys):
    """`--resume /nonexistent` said "config file /nonexistent/config.toml does not exist" (a new user)."""
    from learner.main import main

    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "not a run directory (no config.toml there)" in capsys.readouterr().err


def test_a_port_in_use_is_said_in_one_line_before_anything_loads(tmp_path, capsys, tiny_model):
    """A second learner on a busy port (or resuming a run another learner serves) loaded the
    model, then died in a 40-line traceback, leaving an empty run directory behind."""
    import socket

    from learner.main import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = main(["--model.path", str(tiny_model), "--run.dir", str(tmp_path), "--server.port", str(port),
                     "--run.steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"127.0.0.1:{port} is in use" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no run directory left behind


def test_a_run_directory_another_learner_serves_is_not_resumed_beside_it(tmp_path, capsys, tiny_model):
    """`--resume RUN --server.port N` beside the learner serving RUN started a second learner on
    it, which overwrote its url file (a new user). The run directory is held while served."""
    import os

    from learner.config import load_learner_config
    from learner.main import main
    from learner.rundir import RunDir

    cfg = load_learner_config(None, ["--model.path", str(tiny_model), "--run.dir", str(tmp_path)])
    live = RunDir(cfg)
    live.create(cfg)
    assert live.hold() is None  # the learner serving it
    code = main(["--resume", str(live.path), "--server.port", "0", "--run.steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and f"is served by another learner (pid {os.getpid()})" in err and "Traceback" not in err
    assert not (live.path / "url").exists()
    live._lock.close()  # the first learner ends: the directory may be resumed
    assert RunDir(cfg, live.path).hold() is None
