"""The tools' reports as text. Pure formatting of the JSON-ready dicts, so the table
and ``--json`` always show the same numbers."""

from __future__ import annotations

from typing import Any


def queues_table(report: dict[str, Any]) -> str:
    cfg, tp = report["config"], report["throughput"]
    budget = _budget(cfg.get("items"), cfg.get("duration_s"), "items")
    lines = [
        f"queues benchmark   mode {cfg['mode']}  tensor [{cfg['batch']}, "
        f"{', '.join(map(str, cfg['sample_shape']))}] {cfg['dtype']}  "
        f"request {cfg['request_size']} sample(s) = {_bytes(report['item_bytes'])}  "
        f"ring {cfg['ring_size']} slots",
        f"budget             warm-up {cfg['warmup_items']} items, then {budget}",
        f"measured           {report['items']} items  {report['samples']} samples  "
        f"{_bytes(report['bytes'])}  in {report['duration_s']:.3f} s",
        f"throughput         {tp['items_per_s']:.0f} items/s  "
        f"{tp['samples_per_s']:.0f} samples/s  {tp['gb_per_s']:.3f} GB/s",
        "latency us         " + _percentiles(report["latency_us"]),
    ]
    if "device_runs" in report:
        lines.append(
            f"device             {report['device_runs']} runs  "
            f"{report['padding_samples']} padding samples"
        )
    return "\n".join(lines + _interrupted(report))


def callbacks_table(report: dict[str, Any]) -> str:
    tp, moved = report["throughput"], report["bytes"]
    source = ", ".join(report["files"]) or f"generated {report['model']}"
    lines = [
        f"callbacks benchmark  model {report['model']} ({source})",
        f"device               {report['device']}",
        f"time scale           IPUSERVE_SIM_TIME_SCALE={report['time_scale']:g}  "
        f"effective {report['effective_time_scale']:g}"
        + ("  (model takes no simulated time)" if report["zero_time_model"] else ""),
        f"zero-copy inputs     {'yes' if report['zero_copy'] else 'no'}",
        f"measured             {report['runs']} runs after {report['warmup_runs']} warm-up, "
        f"in {report['duration_s']:.3f} s",
        f"throughput           {tp['runs_per_s']:.0f} runs/s  {tp['gb_per_s']:.3f} GB/s "
        f"(in {tp['input_gb_per_s']:.3f}, out {tp['output_gb_per_s']:.3f})",
        f"bytes                in {_bytes(moved['input'])}  out {_bytes(moved['output'])}",
        "run us               " + _percentiles(report["run_us"]),
        "input callback us    " + _percentiles(report["callback_us"]["input"]),
        "output callback us   " + _percentiles(report["callback_us"]["output"]),
        "anchors:",
    ]
    lines += [
        f"  {a['direction']:6} {a['name']:24} {a['dtype']:8} {a['shape']!s:16} "
        f"{_bytes(a['bytes']):>10} x {a['calls']}"
        for a in report["anchors"]
    ]
    return "\n".join(lines + _interrupted(report))


def real_data_table(report: dict[str, Any]) -> str:
    lines = [
        f"model     {report['model']} ({', '.join(report['files'])})  "
        f"replicas {report['replicas']}  batching dim {report['batching_dim']}",
        "inputs:",
        *(_tensor_line(name, t) for name, t in report["inputs"].items()),
        "outputs:",
        *(_tensor_line(name, t) for name, t in report["outputs"].items()),
        f"runs      {report['runs']} in {report['duration_s']:.3f} s "
        f"({report['runs_per_s']:.1f} runs/s; load {report['load_s']:.3f} s; "
        f"IPUSERVE_SIM_TIME_SCALE={report['time_scale']:g})"
        + ("" if report["identical_across_runs"] else "  WARNING: outputs differ between runs"),
        "run us    " + _percentiles(report["run_us"]),
    ]
    return "\n".join(lines + _interrupted(report))


def _tensor_line(name: str, t: dict[str, Any]) -> str:
    stats = (
        "empty"
        if t["min"] is None
        else f"min {t['min']:.6g}  max {t['max']:.6g}  mean {t['mean']:.6g}"
    )
    return f"  {name:20} {t['dtype']:8} {t['shape']!s:16} {stats}  {t['file']}"


def _percentiles(summary: dict[str, float]) -> str:
    keys = ("p50", "p90", "p99", "max", "mean")
    return "  ".join(f"{k} {summary[k]:.1f}" for k in keys)


def _budget(count: int | None, duration_s: float | None, unit: str) -> str:
    parts = ([f"{count} {unit}"] if count else []) + ([f"{duration_s:g} s"] if duration_s else [])
    return " or ".join(parts) + (" (whichever first)" if len(parts) == 2 else "")


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _interrupted(report: dict[str, Any]) -> list[str]:
    return (
        ["INTERRUPTED: the figures cover what completed before Ctrl-C"]
        if report.get("interrupted")
        else []
    )
