"""`echo-worker doctor [URL] [--token T]`: is this machine fit to be a worker? One line per
check, PASS / FAIL / SKIP, the lines a user pastes into a bug report:

    gpu       the GPU and its driver (nvidia-smi, torch.cuda); no GPU is said plainly (SKIP)
    engine    which engine `[engine] type = "auto"` would run, and its version
    disk      free space where the model is cached ([worker] cache_dir)
    learner   round-trip time to the learner (median of 5 requests to /v1/health)
    download  bandwidth from the learner (its model files, /v1/model)
    clock     skew against the learner's clock (its HTTP Date header)
    generate  a tiny generation with torch on this machine's device (a random 1-layer model)

Exit status 0 when nothing FAILed (a SKIP is not a failure: a CPU-only machine passes).
"""

from __future__ import annotations

import email.utils
import importlib.metadata
import shutil
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


#: A download smaller than this measures round trips and slow start, not the link.
MEASURABLE_BYTES = 4 << 20


@dataclass
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str

    def line(self) -> str:
        return f"{self.status:<4} {self.name:<9} {self.detail}"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_gpu() -> Check:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0 and out.stdout.strip():
                gpus = [line.strip() for line in out.stdout.strip().splitlines()]
                return Check("gpu", "PASS", f"{len(gpus)} × {gpus[0]} (name, driver, memory)")
            return Check("gpu", "FAIL", f"nvidia-smi failed ({out.returncode}): {(out.stderr or out.stdout).strip()[:200]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            return Check("gpu", "FAIL", f"nvidia-smi did not answer: {e}")
    try:
        import torch

        if torch.cuda.is_available():
            return Check("gpu", "PASS", f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)} "
                                        f"(CUDA {torch.version.cuda}; no nvidia-smi)")
    except Exception:  # torch missing or broken: the engine check says so
        pass
    return Check("gpu", "SKIP", "no GPU on this machine (no nvidia-smi, torch.cuda unavailable): it can only run "
                                "the transformers engine on CPU")


def check_engine() -> Check:
    vllm, transformers, torch = _version("vllm"), _version("transformers"), _version("torch")
    if vllm:
        return Check("engine", "PASS", f"vllm {vllm} (torch {torch})")
    if transformers and torch:
        return Check("engine", "PASS", f"transformers {transformers} (torch {torch}); vllm not installed")
    return Check("engine", "FAIL", f"no engine: vllm not installed, transformers {transformers}, torch {torch}")


def check_disk(path: Path, min_gb: float) -> Check:
    path = Path(path)
    probe = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free / 1e9
    status = "PASS" if free >= min_gb else "FAIL"
    return Check("disk", status, f"{free:.1f} GB free at {probe.resolve()} (need ≥ {min_gb:g} GB)")


def _get(url: str, token: str, timeout: float = 10.0) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def check_learner(url: str, token: str) -> list[Check]:
    url = url.rstrip("/")
    rtts, dates = [], []
    try:
        for _ in range(5):
            t0 = time.time()
            # No credential: a refused one is answered a second late, and a machine token is
            # not the operator's (/v1/status refused it five times, a fifth of its address's budget).
            _, _, headers = _get(f"{url}/v1/health", "")
            t1 = time.time()
            rtts.append((t1 - t0) * 1e3)
            if headers.get("Date"):
                dates.append((email.utils.parsedate_to_datetime(headers["Date"]).timestamp(), (t0 + t1) / 2))
    except (OSError, urllib.error.URLError) as e:
        fail = f"cannot reach {url}: {getattr(e, 'reason', e)}"
        return [Check("learner", "FAIL", fail), Check("download", "SKIP", "learner unreachable"),
                Check("clock", "SKIP", "learner unreachable")]
    rtt = statistics.median(rtts)
    out = [Check("learner", "PASS", f"{url} answers, round trip {rtt:.1f} ms")]
    t0 = time.time()
    status, body, _ = _get(f"{url}/v1/model", token, timeout=120)
    dt = max(time.time() - t0, 1e-6)
    if status == 200:
        # The model's config and tokenizer (weights come by broadcast): a few KB say nothing of the
        # link, and "1 Mbit/s" read like a slow one.
        rate = (f"{len(body) * 8 / dt / 1e6:.0f} Mbit/s" if len(body) >= MEASURABLE_BYTES
                else "too small to measure the link (the weights come by broadcast)")
        out.append(Check("download", "PASS", f"{len(body) / 1e6:.2f} MB of model files in {dt:.2f} s: {rate}"))
    else:
        why = ": the token was refused, check --token" if status in (401, 403) else ""
        out.append(Check("download", "FAIL", f"/v1/model answered HTTP {status}{why}"))
    if dates:
        # The Date header has 1 s resolution: skews under 2 s cannot be told apart from none.
        skew = statistics.median(server - local for server, local in dates)
        ok = abs(skew) < 5.0
        out.append(Check("clock", "PASS" if ok else "FAIL", f"skew {skew:+.1f} s against the learner (±1 s resolution)"
                         + ("" if ok else ": sync this machine's clock (NTP)")))
    else:
        out.append(Check("clock", "SKIP", "the learner sent no Date header"))
    return out


def check_generation() -> Check:
    try:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        model = Qwen2ForCausalLM(cfg).to(device).eval()
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
        dt = time.time() - t0
        new = out.shape[1] - 3
        if new != 8:
            return Check("generate", "FAIL", f"asked for 8 tokens, got {new}")
        return Check("generate", "PASS", f"8 tokens from a random 1-layer model on {device} in {dt * 1e3:.0f} ms")
    except Exception as e:
        return Check("generate", "FAIL", f"{type(e).__name__}: {e}"[:300])


def run(url: str | None, token: str, cache_dir: Path, min_disk_gb: float, print_line=print) -> int:
    checks = [check_gpu(), check_engine(), check_disk(cache_dir, min_disk_gb)]
    for c in checks:
        print_line(c.line())
    more = check_learner(url, token) if url else [Check(n, "SKIP", "no learner URL given")
                                                  for n in ("learner", "download", "clock")]
    for c in more:
        print_line(c.line())
    gen = check_generation()
    print_line(gen.line())
    checks += [*more, gen]
    failed = [c.name for c in checks if c.status == "FAIL"]
    print_line(f"echo-worker doctor: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    return 1 if failed else 0
