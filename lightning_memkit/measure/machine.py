"""The balance of a training device, measured: GEMM throughput per dtype, memory bandwidth, host-link bandwidth.

:func:`probe_machine` times a few large operations on the device (about a second on a CPU, less on a GPU) and caches
the answer per device for the process and, unless ``MEMKIT_MACHINE_CACHE=0``, in a JSON file (``MEMKIT_CACHE_DIR``,
else ``~/.cache/lightning_memkit``) keyed by the device's name, its core count and the torch version. The
planner's step time model prices a step with it (:func:`step_seconds`): its matmul and attention FLOPs at the GEMM
rate of its dtype, twice the bytes its other operators write at the memory bandwidth, the bytes it moves between
host and device at the link's. :data:`H100` is the balance assumed for a CUDA device that is not here to probe.

A measured balance depends on the machine and on how busy it is; a plan ranked with it can differ from one machine
to the next. :func:`planning_balance` is the balance the planner ranks with: one given (``MemoryBudget(machine=...)``,
``memkit estimate --machine``), else the one the environment pins (``MEMKIT_MACHINE``: a preset name such as
``h100``, a JSON object of :class:`MachineBalance`'s fields, or the path of a file holding one), else the probe's.
:func:`machine_balance` reads any of these forms.

Example (a balance given, not measured)::

    >>> from lightning_memkit.measure.machine import MachineBalance, step_seconds
    >>> m = MachineBalance("a device", gemm_flops={"float32": 1e12}, memory_bytes_per_s=1e11, link_bytes_per_s=1e10)
    >>> step_seconds(m, flops=2e12, write_bytes=5e10, link_bytes=1e10, dtype="float32")
    4.0
    >>> machine_balance('{"gemm_flops": {"float32": 1e12}, "memory_bytes_per_s": 1e11, "link_bytes_per_s": 1e10}')
    MachineBalance(device='machine', gemm_flops={'float32': 1000000000000.0}, memory_bytes_per_s=100000000000.0, \
link_bytes_per_s=10000000000.0, host_memory_bytes_per_s=0.0, collective_bytes_per_s=0.0)
    >>> machine_balance("h100") is H100
    True
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["H100", "PRESETS", "MachineBalance", "machine_balance", "planning_balance", "probe_machine", "step_seconds"]

_DTYPES = ("float32", "bfloat16", "float16")
_CACHE: dict[str, MachineBalance] = {}
_VERSION = 2  # of the probe: a cached answer of another version is measured again


@dataclass(frozen=True)
class MachineBalance:
    """What a device does per second: dense GEMM FLOPs per dtype name, memory bytes (read plus write), and bytes
    copied between host and device (on a CPU: a copy within host memory)."""

    device: str
    gemm_flops: dict[str, float] = field(default_factory=dict)
    memory_bytes_per_s: float = 0.0
    link_bytes_per_s: float = 0.0
    host_memory_bytes_per_s: float = 0.0  # the host's memory (where an offloaded optimizer steps); 0: the device's
    collective_bytes_per_s: float = 0.0  # an all-gather's bus bandwidth between the devices; 0: the host link's

    @property
    def collective_bandwidth(self) -> float:
        """The bytes per second a collective moves between the devices (the host link's where not known)."""
        return self.collective_bytes_per_s or self.link_bytes_per_s

    @property
    def host_bandwidth(self) -> float:
        """The host's memory bandwidth: the device's own on a CPU."""
        return self.host_memory_bytes_per_s or self.memory_bytes_per_s

    def gemm(self, dtype: str) -> float:
        """The GEMM rate of ``dtype`` (``"bfloat16"``, ``"float32"``; another dtype: the slowest measured)."""
        return self.gemm_flops.get(dtype) or min(self.gemm_flops.values())


# H100 SXM: about 989 dense bf16 TFLOP/s (fp32 through TF32 at half), 3.35 TB/s of HBM3, a PCIe 5 x16 link (~55 GB/s
# measured for pinned copies), NVLink 4 between the GPUs (~360 GB/s of all-gather bus bandwidth in NCCL's tests): the
# balance assumed for a CUDA device this machine does not have.
H100 = MachineBalance("NVIDIA H100 SXM (assumed)", {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
                      3.35e12, 55e9, collective_bytes_per_s=360e9)


#: balances by name, for ``machine_balance("h100")`` and ``MEMKIT_MACHINE=h100``
PRESETS: dict[str, MachineBalance] = {"h100": H100}
_FIELDS = ("device", "gemm_flops", "memory_bytes_per_s", "link_bytes_per_s", "host_memory_bytes_per_s",
           "collective_bytes_per_s")
_ENV = "MEMKIT_MACHINE"


def machine_balance(spec: Any, name: str = "machine", owner: str | None = None) -> MachineBalance:
    """``spec`` as a :class:`MachineBalance`: one already, a preset name (:data:`PRESETS`), a mapping of its fields
    (``device``, its name, optional: where it was given), or that mapping as a JSON object, inline or in a file named
    by its path. Anything else is a ``ValueError``/``TypeError`` naming ``name`` (of ``owner``) and what is
    allowed."""
    where = f"{owner}({name}=...)" if owner else name
    allowed = (f"a preset ({', '.join(PRESETS)}), a JSON object of {', '.join(_FIELDS)} (device optional), or the "
               "path of a file holding one")
    if isinstance(spec, MachineBalance):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower() in PRESETS:
            return PRESETS[text.lower()]
        if not text.startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as err:
                raise ValueError(f"{where} must be {allowed}; got {spec!r} ({err.strerror or err})") from None
        try:
            spec = json.loads(text)
        except ValueError as err:
            raise ValueError(f"{where} must be {allowed}; got {spec!r}, not JSON ({err})") from None
    if not isinstance(spec, dict):
        raise TypeError(f"{where} must be {allowed}; got {spec!r}")
    return _from_fields(spec, where, allowed)


def _from_fields(fields: dict, where: str, allowed: str) -> MachineBalance:
    unknown = sorted(set(fields) - set(_FIELDS))
    missing = [k for k in _FIELDS[1:4] if k not in fields]
    if unknown or missing:
        what = "; ".join(f"{label} {', '.join(keys)}" for label, keys in (("unknown", unknown), ("missing", missing))
                         if keys)
        raise ValueError(f"{where} must be {allowed}: {what}")
    gemm = fields["gemm_flops"]
    rates = [fields[k] for k in _FIELDS[2:] if k in fields]
    if (not isinstance(gemm, dict) or not gemm or not all(_positive(v) for v in gemm.values())
            or not all(_positive(v) for v in rates[:2]) or not all(_positive(v) or v == 0 for v in rates[2:])):
        raise ValueError(f"{where}: gemm_flops must map dtype names to rates > 0 and the bandwidths must be > 0 "
                         f"(host_memory_bytes_per_s >= 0); got {fields!r}")
    return MachineBalance(str(fields.get("device", where)), {str(k): float(v) for k, v in gemm.items()},
                          *(float(v) for v in rates))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def planning_balance(target: str = "cpu", machine: Any = None) -> MachineBalance:
    """The balance the planner ranks plans with on ``target`` (``"cpu"`` or ``"cuda"``): ``machine`` when given
    (any form :func:`machine_balance` reads), else the ``MEMKIT_MACHINE`` environment variable's when set, else the
    device's probe (:func:`probe_machine`), or :data:`H100`'s for a CUDA device this machine does not have."""
    if machine is not None:
        return machine_balance(machine)
    pinned = os.environ.get(_ENV, "").strip()
    if pinned:
        return machine_balance(pinned, _ENV)
    if target == "cuda" and not torch.cuda.is_available():
        return H100
    return probe_machine(target)


def step_seconds(machine: MachineBalance, flops: float, write_bytes: float, link_bytes: float = 0.0,
                 dtype: str = "float32") -> float:
    """A step's time in the model: ``flops`` at the GEMM rate of ``dtype``, ``write_bytes`` written and read once
    more at the memory bandwidth, ``link_bytes`` at the host link's."""
    seconds = flops / machine.gemm(dtype) + 2 * write_bytes / machine.memory_bytes_per_s
    return seconds + (link_bytes / machine.link_bytes_per_s if link_bytes else 0.0)


def probe_machine(device: str | torch.device = "cpu", *, cache: bool = True) -> MachineBalance:
    """The balance of ``device``, measured once per device (see the module doc)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = _device_key(device)
    if cache and key in _CACHE:
        return _CACHE[key]
    found = _read_cached(key) if cache else None
    if found is None:
        found = _measure(device, key)
        if cache:
            _write_cached(key, found)
    _CACHE[key] = found
    return found


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        import platform

        name = f"{platform.machine()} {platform.processor() or 'cpu'} x{torch.get_num_threads()} threads"
    return f"{device.type}: {name} (torch {torch.__version__})"


def _best_seconds(fn: Any, device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up: allocation, kernel selection
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(device: torch.device, key: str) -> MachineBalance:
    n = 4096 if device.type == "cuda" else 768
    gemm = {}
    generator = torch.Generator(device=device).manual_seed(0)  # the global random state is never drawn from
    for name in _DTYPES:
        a = torch.randn(n, n, device=device, generator=generator).to(getattr(torch, name))
        gemm[name] = 2 * n**3 / _best_seconds(lambda a=a: torch.mm(a, a), device)
    size = 128 * 2**20  # beyond the caches
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    memory = 2 * size / _best_seconds(lambda: dst.copy_(src), device)
    if device.type == "cuda":
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        link = size / _best_seconds(lambda: src.copy_(host, non_blocking=True), device)
        other = torch.empty_like(host)
        host_memory = 2 * size / _best_seconds(lambda: other.copy_(host), torch.device("cpu"))
    else:
        link = size / _best_seconds(lambda: dst.copy_(src), device)
        host_memory = 0.0
    return MachineBalance(key, gemm, memory, link, host_memory)


def _cache_file() -> Path | None:
    if os.environ.get("MEMKIT_MACHINE_CACHE", "1") == "0":
        return None
    root = os.environ.get("MEMKIT_CACHE_DIR") or Path.home() / ".cache" / "lightning_memkit"
    return Path(root) / "machine.json"


def _read_cached(key: str) -> MachineBalance | None:
    path = _cache_file()
    try:
        entry = json.loads(path.read_text())[key] if path is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(entry, dict) or entry.pop("version", None) != _VERSION:
        return None
    try:
        return MachineBalance(**entry)
    except TypeError:
        return None


def _write_cached(key: str, balance: MachineBalance) -> None:
    path = _cache_file()
    if path is None:
        return
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        entries = {}  # a damaged cache is written anew
    entries = entries if isinstance(entries, dict) else {}
    try:
        entries[key] = {**asdict(balance), "version": _VERSION}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)  # whole or not at all
    except (OSError, ValueError):
        pass  # a cache that cannot be written is measured again next time
