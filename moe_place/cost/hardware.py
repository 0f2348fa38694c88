"""Hardware catalog: datasheet peaks of GPUs, CPUs and NICs, and the efficiency applied to them.

The cost model never uses a peak directly: compute and memory rates are multiplied by the part's
`efficiency` (default 0.5: half the datasheet peak, docs/MODEL.md). Link rates (NVLink, PCIe, NIC) are
used as given, per direction, as the worked examples do. CPU figures of the Xeon Platinum 8452Y
are *measured* (KTransformers paper, MLC), so its efficiency is 1.0.

The built-in parts are written in the same schema a user file uses, so both go through one parser:

    [gpu."My GPU"]            # TOML; JSON is {"gpu": {"My GPU": {...}}}
    bf16_tflops = 500         # dense BF16 peak, TFLOP/s
    fp8_tflops = 1000         # optional
    hbm_gb_per_s = 3000       # GB/s (decimal)
    memory_gb = 96            # GB (decimal, as datasheets give it)
    nvlink_gb_per_s = 450     # per direction; 0 = no NVLink switch
    pcie_gb_per_s = 64        # per direction, to host and NIC
    efficiency = 0.5          # optional
    aliases = ["MyGPU"]       # optional

    [cpu."My CPU"]
    tflops = { avx512 = 2.0, amx = 20.0 }   # per kernel
    local_gb_per_s = 300
    remote_gb_per_s = 150                    # optional: the other socket's memory
    memory_gb = 1000

    [nic."My NIC"]
    gbit_per_s = 400
    messages_per_s = 5.4e7                   # optional: request issue rate
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from moe_place.cost.files import get_number, read_table_file
from moe_place.cost.gemm_profile import GemmProfile, profile_from_record, reference_profile
from moe_place.cost.units import GB_BYTES, TFLOPS, gb_per_s, gbit_per_s
from moe_place.errors import InputError, check_keys

__all__ = ["Catalog", "CpuSpec", "GpuSpec", "NicSpec", "gpu_from_record", "load_catalog", "parse_parts"]

DEFAULT_EFFICIENCY = 0.5
DEFAULT_GPU = "H100"   # the part every command and engine adapter prices when none is named


@dataclass(frozen=True)
class GpuSpec:
    """A GPU: datasheet peaks (dense, per direction) and the efficiency applied to compute and HBM."""

    name: str
    bf16_flops_per_s: float
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    fp8_flops_per_s: float = 0.0
    efficiency: float = DEFAULT_EFFICIENCY
    notes: str = ""
    gemm: GemmProfile | None = None  # formula 11's terms measured on this part (`gpu_from_record`), else None

    def __post_init__(self) -> None:
        for key in ("bf16_flops_per_s", "hbm_bytes_per_s", "memory_bytes", "pcie_bytes_per_s"):
            _require(getattr(self, key) > 0, f"{self.name}.{key}", "a number > 0", getattr(self, key))
        for key in ("nvlink_bytes_per_s", "fp8_flops_per_s"):
            _require(getattr(self, key) >= 0, f"{self.name}.{key}", "a number >= 0", getattr(self, key))
        _require(0 < self.efficiency <= 1, f"{self.name}.efficiency", "a fraction in (0, 1]", self.efficiency)

    @property
    def kind(self) -> str:
        return "gpu"

    @property
    def flops_per_s(self) -> float:
        """Effective BF16 FLOP/s (peak x efficiency)."""
        return self.bf16_flops_per_s * self.efficiency

    @property
    def memory_bytes_per_s(self) -> float:
        """Effective HBM bytes/s (peak x efficiency)."""
        return self.hbm_bytes_per_s * self.efficiency

    def with_efficiency(self, efficiency: float) -> "GpuSpec":
        return GpuSpec(**{**self.__dict__, "efficiency": efficiency})

    def gemm_profile(self) -> GemmProfile:
        """The terms of formula 11 (the calibrated expert time): this part's own, measured, when it has
        them (`gemm`), else the H200 record's fit scaled by this part's effective rates (`reference_profile`)."""
        if self.gemm is not None:
            return self.gemm
        return reference_profile(self.name, self.flops_per_s, self.memory_bytes_per_s)


@dataclass(frozen=True)
class CpuSpec:
    """A CPU socket: FLOP/s per kernel (e.g. avx512, amx), local and remote-socket memory bandwidth."""

    name: str
    kernel_flops_per_s: tuple[tuple[str, float], ...]
    local_bytes_per_s: float
    remote_bytes_per_s: float = 0.0
    memory_bytes: float = 0.0
    efficiency: float = 1.0
    notes: str = ""

    def __post_init__(self) -> None:
        _require(len(self.kernel_flops_per_s) > 0, f"{self.name}.tflops", "at least one kernel")
        for kernel, rate in self.kernel_flops_per_s:
            _require(rate > 0, f"{self.name}.tflops.{kernel}", "a number > 0", rate)
        _require(self.local_bytes_per_s > 0, f"{self.name}.local_gb_per_s", "a number > 0", self.local_bytes_per_s)
        _require(self.remote_bytes_per_s >= 0, f"{self.name}.remote_gb_per_s", "a number >= 0", self.remote_bytes_per_s)
        _require(0 < self.efficiency <= 1, f"{self.name}.efficiency", "a fraction in (0, 1]", self.efficiency)

    @property
    def kind(self) -> str:
        return "cpu"

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.kernel_flops_per_s)

    def flops_per_s(self, kernel: str) -> float:
        """Effective FLOP/s of one kernel (figure x efficiency)."""
        for name, rate in self.kernel_flops_per_s:
            if name == kernel:
                return rate * self.efficiency
        raise InputError(f"{self.name}: kernel", f"one of {list(self.kernels)}", repr(kernel))

    def memory_bytes_per_s(self, socket: str = "local") -> float:
        """Effective DRAM bytes/s reading the weights from the `local` or `remote` socket."""
        if socket == "local":
            rate = self.local_bytes_per_s
        elif socket == "remote":
            _require(self.remote_bytes_per_s > 0, f"{self.name}.remote_gb_per_s", "a remote-socket bandwidth")
            rate = self.remote_bytes_per_s
        else:
            raise InputError(f"{self.name}: socket", "'local' or 'remote'", repr(socket))
        return rate * self.efficiency


@dataclass(frozen=True)
class NicSpec:
    """A network adapter: bytes/s per direction and how many requests (messages) it issues per second."""

    name: str
    bytes_per_s: float
    messages_per_s: float = 0.0
    notes: str = ""

    def __post_init__(self) -> None:
        _require(self.bytes_per_s > 0, f"{self.name}.gbit_per_s", "a number > 0", self.bytes_per_s)
        _require(self.messages_per_s >= 0, f"{self.name}.messages_per_s", "a number >= 0", self.messages_per_s)

    @property
    def kind(self) -> str:
        return "nic"


Part = GpuSpec | CpuSpec | NicSpec

# Built-in parts, in the user-file schema. Sources: NVIDIA datasheets (dense BF16/FP8 Tensor Core,
# HBM, NVLink per direction = half the bidirectional figure, PCIe per direction); the Xeon figures are
# the KTransformers paper's measurements that the worked examples use (docs/MODEL.md, C10).
BUILTIN_PARTS: dict = {
    "gpu": {
        "H100-SXM": dict(bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb_per_s=3350, memory_gb=80,
                         nvlink_gb_per_s=450, pcie_gb_per_s=64, aliases=["H100", "H100 SXM", "H100-SXM5"],
                         notes="HGX H100: NVLink 4 900 GB/s bidirectional, PCIe Gen5 x16"),
        "H200": dict(bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb_per_s=4800, memory_gb=141,
                     nvlink_gb_per_s=450, pcie_gb_per_s=64, aliases=["H200-SXM", "H200 SXM"]),
        "H800": dict(bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb_per_s=3350, memory_gb=80,
                     nvlink_gb_per_s=200, pcie_gb_per_s=64, aliases=["H800-SXM", "H800 SXM"],
                     notes="export variant of H100 SXM: NVLink 400 GB/s bidirectional"),
        "A100-80GB-SXM": dict(bf16_tflops=312, hbm_gb_per_s=2039, memory_gb=80, nvlink_gb_per_s=300,
                              pcie_gb_per_s=32, aliases=["A100", "A100-SXM", "A100 80GB SXM", "A100-80GB"]),
        "A100-40GB-PCIe": dict(bf16_tflops=312, hbm_gb_per_s=1555, memory_gb=40, nvlink_gb_per_s=0,
                               pcie_gb_per_s=32, aliases=["A100-PCIe", "A100 40GB PCIe", "A100-40GB"],
                               notes="PCIe 4.0 x16 32 GB/s theoretical; the worked examples use 25 GB/s for transfers"),
        "H20": dict(bf16_tflops=148, fp8_tflops=296, hbm_gb_per_s=4096, memory_gb=96, nvlink_gb_per_s=450,
                    pcie_gb_per_s=64),
        "B200": dict(bf16_tflops=2250, fp8_tflops=4500, hbm_gb_per_s=8000, memory_gb=180, nvlink_gb_per_s=900,
                     pcie_gb_per_s=128, aliases=["B200-SXM", "HGX-B200"],
                     notes="HGX B200 per GPU: NVLink 5 1.8 TB/s and PCIe Gen6 256 GB/s bidirectional"),
    },
    "cpu": {
        "Xeon-Platinum-8452Y": dict(tflops={"avx512": 1.8, "amx": 21.3}, local_gb_per_s=220, remote_gb_per_s=125,
                                    memory_gb=1000, efficiency=1.0, aliases=["8452Y", "Xeon 8452Y"],
                                    notes="one socket, 36 cores; measured (KTransformers): PyTorch AVX-512 and "
                                          "AMX kernels, MLC local/remote-socket bandwidth"),
    },
    "nic": {
        "ConnectX-7": dict(gbit_per_s=400, messages_per_s=54e6, aliases=["CX7", "ConnectX-7-400G"],
                           notes="400 Gbit/s = 50 GB/s per direction; ~54 M requests/s as row C13 uses"),
    },
}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "-", str(name).strip().lower())


@dataclass(frozen=True)
class Catalog:
    """Named parts; look-ups ignore case and treat spaces, `_` and `-` alike."""

    parts: tuple[Part, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, Part] = {}
        for part in self.parts:
            index[_key(part.name)] = part
        by_name = {part.name: part for part in self.parts}
        for alias, target in self.aliases:
            index.setdefault(_key(alias), by_name[target])
        self._index.update(index)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.name for part in self.parts)

    def get(self, name: str, kind: str | None = None) -> Part:
        part = self._index.get(_key(name))
        if part is None or (kind is not None and part.kind != kind):
            known = [p.name for p in self.parts if kind is None or p.kind == kind]
            raise InputError(f"{kind or 'hardware'} part", f"one of {', '.join(known)}", repr(name))
        return part

    def gpu(self, name: str) -> GpuSpec:
        return self.get(name, "gpu")  # type: ignore[return-value]

    def cpu(self, name: str) -> CpuSpec:
        return self.get(name, "cpu")  # type: ignore[return-value]

    def nic(self, name: str) -> NicSpec:
        return self.get(name, "nic")  # type: ignore[return-value]

    def merged(self, other: "Catalog") -> "Catalog":
        """This catalog plus `other`'s parts; a part of `other` replaces one of the same name."""
        replaced = {_key(p.name) for p in other.parts}
        keep = tuple(p for p in self.parts if _key(p.name) not in replaced)
        names = {p.name for p in keep + other.parts}
        aliases = tuple(a for a in self.aliases + other.aliases if a[1] in names)
        return Catalog(keep + other.parts, aliases)


PART_KEYS = {  # the figures a part of each kind may have (what _parse_part reads)
    "gpu": ("bf16_tflops", "fp8_tflops", "hbm_gb_per_s", "memory_gb", "nvlink_gb_per_s", "pcie_gb_per_s",
            "efficiency", "notes", "aliases"),
    "cpu": ("tflops", "local_gb_per_s", "remote_gb_per_s", "memory_gb", "efficiency", "notes", "aliases"),
    "nic": ("gbit_per_s", "messages_per_s", "notes", "aliases"),
}


def parse_parts(table: dict, where: str = "parts") -> Catalog:
    """Build a catalog from the user-file schema (see the module docstring)."""
    parts: list[Part] = []
    aliases: list[tuple[str, str]] = []
    for kind, entries in table.items():
        if kind not in ("gpu", "cpu", "nic"):
            raise InputError(f"{where}: [{kind}]", "a [gpu.NAME], [cpu.NAME] or [nic.NAME] table")
        if not isinstance(entries, dict):
            raise InputError(f"{where}: [{kind}]", "a table of named parts", type(entries).__name__)
        for name, entry in entries.items():
            here = f"{where}: {kind}.{name}"
            if not isinstance(entry, dict):
                raise InputError(here, "a table of figures", type(entry).__name__)
            check_keys(entry, PART_KEYS[kind], here)
            parts.append(_parse_part(kind, name, entry, here))
            for alias in entry.get("aliases", ()):
                aliases.append((str(alias), name))
    return Catalog(tuple(parts), tuple(aliases))


def _parse_part(kind: str, name: str, entry: dict, where: str) -> Part:
    notes = str(entry.get("notes", ""))
    if kind == "gpu":
        return GpuSpec(
            name=name,
            bf16_flops_per_s=get_number(entry, "bf16_tflops", where) * TFLOPS,
            fp8_flops_per_s=get_number(entry, "fp8_tflops", where, default=0.0, allow_zero=True) * TFLOPS,
            hbm_bytes_per_s=gb_per_s(get_number(entry, "hbm_gb_per_s", where)),
            memory_bytes=get_number(entry, "memory_gb", where) * GB_BYTES,
            nvlink_bytes_per_s=gb_per_s(get_number(entry, "nvlink_gb_per_s", where, default=0.0, allow_zero=True)),
            pcie_bytes_per_s=gb_per_s(get_number(entry, "pcie_gb_per_s", where)),
            efficiency=get_number(entry, "efficiency", where, default=DEFAULT_EFFICIENCY),
            notes=notes)
    if kind == "cpu":
        kernels = entry.get("tflops")
        if not isinstance(kernels, dict) or not kernels:
            raise InputError(f"{where}.tflops", "a table of kernel = TFLOP/s, e.g. { avx512 = 1.8 }", repr(kernels))
        return CpuSpec(
            name=name,
            kernel_flops_per_s=tuple((str(k), get_number(kernels, k, f"{where}.tflops") * TFLOPS) for k in kernels),
            local_bytes_per_s=gb_per_s(get_number(entry, "local_gb_per_s", where)),
            remote_bytes_per_s=gb_per_s(get_number(entry, "remote_gb_per_s", where, default=0.0, allow_zero=True)),
            memory_bytes=get_number(entry, "memory_gb", where, default=0.0, allow_zero=True) * GB_BYTES,
            efficiency=get_number(entry, "efficiency", where, default=1.0),
            notes=notes)
    return NicSpec(name=name, bytes_per_s=gbit_per_s(get_number(entry, "gbit_per_s", where)),
                   messages_per_s=get_number(entry, "messages_per_s", where, default=0.0, allow_zero=True),
                   notes=notes)


@lru_cache(maxsize=1)
def builtin_catalog() -> Catalog:
    """The parts shipped with moe-place (parsed once: a Catalog is immutable)."""
    return parse_parts(BUILTIN_PARTS, "built-in catalog")


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The built-in catalog, plus the parts of a user TOML/JSON file when `path` is given."""
    catalog = builtin_catalog()
    if path is None:
        return catalog
    return catalog.merged(parse_parts(read_table_file(path), str(path)))


def gpu_from_record(path: str | Path, gpu: GpuSpec | None = None, catalog: Catalog | None = None,
                    where: str = "--hardware-from") -> GpuSpec:
    """`gpu` (default: the catalog part a `bench/gpu_check.sh` result names) with formula 11's terms
    fitted on that result (`moe_place.cost.gemm_profile.profile_from_record`). The result must be of
    `gpu`'s part: a profile measured on one GPU says nothing about another."""
    catalog = catalog or builtin_catalog()
    recorded, profile = profile_from_record(path)
    try:
        part = catalog.gpu(recorded)
    except InputError as exc:
        raise InputError(f"{path}: env.gpu_part", f"a GPU of the catalog ({exc.expected})", repr(recorded)) from None
    if gpu is not None and gpu.name != part.name:
        raise InputError(where, f"a gpu_check record of the {gpu.name} (the GPU the command prices)",
                         f"{path}, a record of the {part.name}")
    return GpuSpec(**{**(gpu or part).__dict__, "gemm": profile})


def _require(condition: bool, where: str, expected: str, got: object | None = None) -> None:
    if not condition:
        raise InputError(where, expected, got)
