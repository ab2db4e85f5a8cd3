"""The counters file for dcgm-exporter (`dcgm-exporter -f dcgm/corral-counters.csv`).

dcgm-exporter exports only the DCGM fields its counters file lists, and its stock file
(/etc/dcgm-exporter/default-counters.csv) leaves out the ECC and throttling counters that the GPU alerts
and dashboard read. This file is the stock one's fields with those enabled.
"""

from __future__ import annotations

__all__ = ["COUNTERS_FILE", "DCGM_FIELDS", "counters_csv"]

COUNTERS_FILE = "dcgm/corral-counters.csv"

# (field, Prometheus type, help): dcgm-exporter's default-counters.csv as it ships (3.x and 4.x), then the
# fields it comments out that corral's rules and GPU dashboard read.
_STOCK = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    (
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        "counter",
        "Total number of bytes transmitted through PCIe TX (in KB) via NVML.",
    ),
    (
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
        "counter",
        "Total number of bytes received through PCIe RX (in KB) via NVML.",
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes",
    ),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
)
_ADDED = (
    ("DCGM_FI_DEV_POWER_VIOLATION", "counter", "Throttling duration due to power constraints (in us)."),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "counter", "Throttling duration due to thermal constraints (in us)."),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
)
DCGM_FIELDS = tuple(field for field, _, _ in (*_STOCK, *_ADDED))


def counters_csv() -> str:
    """The counters file: dcgm-exporter's own format, one `field, type, help` a line."""
    lines = [
        "# dcgm-exporter's counters (dcgm-exporter -f this file), written by `corral observe render`:",
        "# its default-counters.csv, and the ECC and throttling counters corral's GPU alerts read.",
        "# DCGM FIELD, Prometheus metric type, help message",
        "",
    ]
    lines += [f"{field}, {kind}, {text}" for field, kind, text in _STOCK]
    lines += ["", "# added by corral (commented out in the stock file)"]
    lines += [f"{field}, {kind}, {text}" for field, kind, text in _ADDED]
    return "\n".join(lines) + "\n"
