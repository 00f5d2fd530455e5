"""Which W4A16 path serves a 4-bit weight at each row count, and with which launch config: data, read from
kernels/w4a16_configs.json (or the file VSERVE_W4A16_CONFIGS names), never from module globals.

The table is keyed by device name (torch.cuda.get_device_name; "cpu" for the CPU path) and weight shape
("N=<out>,K=<in>"), with a per-device and a global "default" entry for shapes without their own. An entry:

    {"layout": "checkpoint" | "tc",
     "rows": {"<M>": {"path": ..., launch keywords ...}, ...}}

- layout "checkpoint": the layer keeps the checkpoint's tensors and kernels/triton_w4a16.py's kernels; row paths
  "auto" (today's thresholds: AWQ GEMV, the split-K tile kernel, the tiled kernel, then dequantize + cuBLAS),
  "fused" (never dequantize) or "dequant" (always);
- layout "tc": the layer repacks its weight once at load (kernels/w4a16_repack.py); row paths "tc" (the tensor-core
  kernel, kernels/triton_w4a16_tc.py, launch keywords block_n, block_m, split_k, num_warps, num_stages, scale_a, wide;
  missing ones from tc_default_config) or "dequant" (dequantize the tc layout + cuBLAS).
A row entry serves M from its key up to the next key (the smallest key serves anything below it); keys starting with
"_" are notes (measured times). Missing rows: path
"auto" (checkpoint) or "tc" (tc). A device entry may name another device as {"same_as": "<device name>"}: its shapes
and default stand in for the ones it lacks (a GPU of the same architecture that --tune has not run on yet: the H200
takes the H100's launches until its own are tuned). Devices the table does not name, and the CPU, keep
"checkpoint"/"auto": today's behaviour, so an untuned GPU is never made slower; benchmarks/kernels/w4a16_tc.py --tune
writes tuned entries.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import torch

CONFIG_FILE = Path(__file__).with_name("w4a16_configs.json")
PATHS = {"checkpoint": ("auto", "fused", "dequant"), "tc": ("tc", "dequant")}
LAUNCH_KEYS = ("block_n", "block_m", "split_k", "num_warps", "num_stages", "scale_a", "wide")


@cache
def table(path: str | None = None) -> dict:
    """The dispatch table (VSERVE_W4A16_CONFIGS, else kernels/w4a16_configs.json), checked once."""
    path = path or os.environ.get("VSERVE_W4A16_CONFIGS") or str(CONFIG_FILE)
    t = json.loads(Path(path).read_text())
    for where, e in _entries(t):
        layout = e.get("layout", "checkpoint")
        if layout not in PATHS:
            raise ValueError(f"{path}: {where}: layout must be one of {', '.join(PATHS)}, got {layout!r}")
        for m, row in e.get("rows", {}).items():
            if not m.isdigit() or row.get("path", PATHS[layout][0]) not in PATHS[layout]:
                raise ValueError(f"{path}: {where}: rows[{m!r}] = {row}: keys are row counts and paths for layout "
                                 f"{layout} are {', '.join(PATHS[layout])}")
            unknown = {k for k in row if not k.startswith("_")} - {"path", *LAUNCH_KEYS}  # "_...": notes
            if unknown:
                raise ValueError(f"{path}: {where}: rows[{m!r}] has unknown keys {sorted(unknown)}")
    devices = t.get("devices", {})
    for dev, d in devices.items():
        like = d.get("same_as")
        if like is not None and (like not in devices or like == dev or "same_as" in devices[like]):
            raise ValueError(f"{path}: devices[{dev!r}].same_as = {like!r}: it must name another device of the table "
                             "that has its own entries (no same_as)")
    return t


def _entries(t: dict):
    yield "default", t.get("default", {})
    for dev, d in t.get("devices", {}).items():
        yield f"devices[{dev!r}].default", d.get("default", {})
        for shape, e in d.get("shapes", {}).items():
            yield f"devices[{dev!r}].shapes[{shape!r}]", e


@cache
def device_name(device: torch.device) -> str:
    return "cpu" if device.type != "cuda" else torch.cuda.get_device_name(device)


def entry(dev: str, N: int, K: int, t: dict | None = None) -> dict:
    """The table entry of an [N, K] weight on device `dev` (device_name): its shape's, else (where it names one as
    same_as) that device's shape entry, else the device's default, then the same_as device's, else the global one."""
    t = t if t is not None else table()
    devices = t.get("devices", {})
    d = devices.get(dev, {})
    like = devices.get(d["same_as"], {}) if "same_as" in d else {}
    key = f"N={N},K={K}"
    return (d.get("shapes", {}).get(key) or like.get("shapes", {}).get(key) or d.get("default")
            or like.get("default") or t.get("default") or {})


def layout_for(device: torch.device, N: int, K: int) -> str:
    """"tc" where the table wants this weight repacked at load, else "checkpoint"."""
    return entry(device_name(device), N, K).get("layout", "checkpoint")


@cache
def _row(dev: str, N: int, K: int, M: int, t_id: int) -> tuple[str, tuple]:
    e = entry(dev, N, K)
    layout = e.get("layout", "checkpoint")
    rows = e.get("rows", {})
    keys = sorted(int(k) for k in rows)
    row = dict(rows[str(max([k for k in keys if k <= M], default=keys[0]))]) if keys else {}
    path = row.pop("path", PATHS[layout][0])
    return path, tuple(sorted((k, v) for k, v in row.items() if not k.startswith("_")))


def choose(device: torch.device, N: int, K: int, M: int) -> tuple[str, dict]:
    """(path, launch keywords given by the table) for M rows through an [N, K] weight on device."""
    path, launch = _row(device_name(device), N, K, M, id(table()))
    return path, dict(launch)


def choose_tc(device: torch.device, N: int, K: int, M: int) -> tuple[str, dict]:
    """choose() for a weight in the tc layout: the table's row where its entry for the shape is "tc", else ("tc", {})
    (a tc weight the table does not know: the kernel with its default launch)."""
    path, launch = choose(device, N, K, M)
    return (path, launch) if path in PATHS["tc"] else ("tc", {})


def row_keys(device: torch.device, N: int, K: int) -> list[int]:
    """The row counts at which the table's entry for an [N, K] weight changes path or launch (its row keys, sorted;
    [1] where it has none): one GEMM at each compiles every kernel variant the weight can run."""
    return sorted(int(k) for k in entry(device_name(device), N, K).get("rows", {})) or [1]


def reload() -> None:
    """Read the table again (after VSERVE_W4A16_CONFIGS or the file changed)."""
    table.cache_clear()
    _row.cache_clear()
