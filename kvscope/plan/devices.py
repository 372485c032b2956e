"""The device table (``devices.yaml``, shipped in the package, every entry with its datasheet) and lookups."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any

import yaml

CPU = "cpu"
"""The device measured on this machine by kvscope.plan.cpu_probe (not in the table)."""

FORMAT_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class UnknownDeviceError(ValueError):
    """The device name is not in the table; the message names the known ones."""


@dataclass(frozen=True, slots=True)
class Device:
    """Memory, bandwidth and peak dense throughput of one accelerator (or of this machine's CPU)."""

    name: str
    memory_bytes: int
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    peak_flops: MappingProxyType
    """Number format (fp32, tf32, bf16, fp16, fp8, int8) → peak dense operations/s."""
    source: str
    vendor: str = ""
    aliases: tuple[str, ...] = ()
    measured: dict[str, Any] = field(default_factory=dict)
    """For ``cpu``: how the probe measured it (threads, buffer size, repeats)."""

    def flops_for(self, fmt: str) -> float:
        """Peak operations/s of number format ``fmt``. Raises ValueError naming the formats the device has."""
        try:
            return self.peak_flops[fmt]
        except KeyError:
            raise ValueError(
                f"device {self.name} has no {fmt} peak in the table; it has {', '.join(self.peak_flops)}"
            ) from None


def _device(name: str, entry: dict[str, Any]) -> Device:
    return Device(
        name=name,
        memory_bytes=int(float(entry["memory_gb"]) * (1 << 30)),
        bandwidth=float(entry["bandwidth_gb_s"]) * 1e9,
        peak_flops=MappingProxyType({k: float(v) * 1e12 for k, v in entry["peak_tflops"].items()}),
        source=str(entry["source"]),
        vendor=str(entry.get("vendor", "")),
        aliases=tuple(entry.get("aliases", ())),
    )


def load_devices() -> dict[str, Device]:
    """Every device of the shipped table, by canonical name (read from the package on each call)."""
    text = resources.files("kvscope.plan").joinpath("devices.yaml").read_text()
    return {name: _device(name, entry) for name, entry in yaml.safe_load(text).items()}


def known_device_names(devices: dict[str, Device] | None = None) -> list[str]:
    """Canonical names of the table plus ``cpu``, sorted."""
    return sorted([*(devices or load_devices()), CPU])


def get_device(name: str, devices: dict[str, Device] | None = None) -> Device:
    """The table entry named ``name`` or one of its aliases (case-insensitive); ``cpu`` is not here (probe
    it).

    Raises UnknownDeviceError naming the known devices.
    """
    devices = devices or load_devices()
    wanted = name.lower()
    for device in devices.values():
        if wanted == device.name or wanted in device.aliases:
            return device
    raise UnknownDeviceError(
        f"unknown device {name!r}; known devices: {', '.join(known_device_names(devices))}"
    )
