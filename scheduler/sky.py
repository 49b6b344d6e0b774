"""SkyPilot through its Python SDK (`pip install skypilot`, with the clouds you use enabled by
`sky check`): one cluster per machine, on whichever of your clouds (RunPod, Lambda, Vast, the
big three…) SkyPilot finds the GPU on.

SkyPilot has no live offer list the way a marketplace does: the candidates are the
`[scheduler.provider] gpus` table, `per_gpu_count` machines of each, planned at `prices` $/h
(and `dollars_per_gb` of traffic); SkyPilot picks the cheapest cloud that has one when it is
launched. The calls used (documented Python API, imported lazily):

    sky.Task.from_yaml_config(task_config(...))   the task: the worker image, its on-start as `run`
    sky.launch(task, cluster_name=..., down=True)  bring a machine up (torn down when the task ends)
    sky.down(cluster_name)                         release it
    sky.status(cluster_names=None, refresh=...)    cluster records: name, status UP / INIT / STOPPED

In SkyPilot ≥ 0.8 these return request ids that `sky.get` resolves; both forms are handled.
What is tested here without a SkyPilot API server or cloud credentials: the task it builds and
the state mapping (tests/unit/scheduler/test_sky.py). The launch/down/status calls themselves
are NOT exercised by the test suite.
"""

from __future__ import annotations

import re
import time

from scheduler.market import Offer


def _sky():
    try:
        import sky
    except ImportError as e:
        raise ImportError("[scheduler.provider] type = 'skypilot' needs SkyPilot: pip install 'skypilot[runpod,lambda,vast]' "
                          "and `sky check`") from e
    return sky


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def accelerator(gpu: str) -> str:
    """SkyPilot's accelerator name for a GPU model: 'RTX 4090' → 'RTX4090', 'A100 80GB' → 'A100-80GB'."""
    name = gpu.upper().replace("NVIDIA ", "").replace("GEFORCE ", "")
    return re.sub(r"^(RTX|GTX)\s+", r"\1", name).replace(" ", "-")


def task_config(*, name: str, gpu: str, image: str, onstart: str, disk_gb: float, use_spot: bool,
                clouds: list[str]) -> dict:
    """The SkyPilot task (its YAML as a dict) for one machine: the worker image as the
    container, the on-start command (`echo-worker join URL --token …`) as `run`."""
    resources: dict = {"accelerators": {accelerator(gpu): 1}, "image_id": f"docker:{image}",
                       "disk_size": int(disk_gb), "use_spot": use_spot}
    if len(clouds) == 1:
        resources["cloud"] = clouds[0]
    elif clouds:
        resources = {"any_of": [{**resources, "cloud": c} for c in clouds]}
    return {"name": name, "resources": resources, "run": onstart}


def cluster_state(status) -> str:
    """'starting' | 'running' | 'stopped' from a SkyPilot ClusterStatus (or its name)."""
    name = getattr(status, "name", None) or getattr(status, "value", None) or str(status)
    name = name.upper().split(".")[-1]
    return {"UP": "running", "INIT": "starting"}.get(name, "stopped")


class SkyMarket:
    name = "sky"

    def __init__(self, *, gpus: dict[str, float], prices: dict[str, float], clouds: list[str], image: str,
                 disk_gb: float = 40.0, use_spot: bool = False, per_gpu: int = 4, dollars_per_gb: float = 0.0,
                 sky_module=None):
        missing = sorted(set(gpus) - set(prices))
        if missing:
            raise ValueError(f"[scheduler.provider] prices has no $/h for {', '.join(missing)}: SkyPilot has no live "
                             "offer list, so the controller plans with the prices you give")
        self.gpus, self.prices, self.clouds, self.image = gpus, prices, clouds, image
        self.disk_gb, self.use_spot, self.per_gpu, self.dollars_per_gb = disk_gb, use_spot, per_gpu, dollars_per_gb
        self._sky = sky_module
        self._launched: dict[str, float] = {}  # cluster → when launch was asked

    @property
    def sky(self):
        if self._sky is None:
            self._sky = _sky()
        return self._sky

    def _get(self, result):
        """SkyPilot ≥ 0.8 returns a request id to resolve; older versions the value itself."""
        get = getattr(self.sky, "get", None)
        return get(result) if get is not None and isinstance(result, str) else result

    def search(self) -> list[Offer]:
        return [Offer(f"{slug(gpu)}-{k}", gpu, 1, float(self.prices[gpu]), dollars_per_gb_down=self.dollars_per_gb,
                      dollars_per_gb_up=self.dollars_per_gb, interruptible=self.use_spot)
                for gpu in self.gpus for k in range(self.per_gpu)]

    def create(self, offer: Offer, label: str, onstart: str) -> str:
        cluster = f"echo-{slug(label)}"
        cfg = task_config(name=cluster, gpu=offer.gpu, image=self.image, onstart=onstart, disk_gb=self.disk_gb,
                          use_spot=self.use_spot, clouds=self.clouds)
        task = self.sky.Task.from_yaml_config(cfg)
        self.sky.launch(task, cluster_name=cluster, down=True)  # a request (≥ 0.8): not waited for here
        self._launched[cluster] = time.monotonic()
        return cluster

    def destroy(self, instance_id: str) -> None:
        self._launched.pop(instance_id, None)
        try:
            self._get(self.sky.down(instance_id))
        except Exception as e:  # already gone is what we wanted
            if "not exist" not in str(e).lower() and "not found" not in str(e).lower():
                raise

    def states(self) -> dict[str, str]:
        records = self._get(self.sky.status(cluster_names=list(self._launched) or None, refresh=True)) or []
        out = {}
        for r in records:
            name = r["name"] if isinstance(r, dict) else getattr(r, "name", "")
            status = r["status"] if isinstance(r, dict) else getattr(r, "status", "")
            if name.startswith("echo-"):
                out[name] = cluster_state(status)
        for cluster, asked in self._launched.items():  # provisioning can take minutes before it is listed
            if cluster not in out and time.monotonic() - asked < 900:
                out[cluster] = "starting"
        return out
