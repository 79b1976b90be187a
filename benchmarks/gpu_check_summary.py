"""The summaries of ``benchmarks/gpu_check.py``: ``gpu_check.json`` and ``gpu_check.md``, from the JSONL.

Written by the orchestrating process at the end of a run (``gpu_check_run.orchestrate``). Standard library
only. Format and how to read it: docs/triton.md, "The GPU check".
"""

from __future__ import annotations


def summarise(records: list[dict]) -> dict:
    """The JSONL grouped: run, device, stages, timing / correctness / SDPA cases, skips, budget stop, problems."""
    by = lambda kind: [r for r in records if r["type"] == kind]  # noqa: E731
    cases = by("case")
    device = next((r for r in cases if r.get("kind") == "device"), None)
    stages = [r for r in records if r["type"] in ("stage_end", "stage_skipped")]
    problems = [f"{r['stage']}: {r['case']}: {r['error'][:160]}" for r in cases if "error" in r]
    problems += [f"{r['stage']}: {r['case']}: correctness FAILED" for r in cases
                 if r.get("kind") == "correctness" and not r.get("ok", True)]
    problems += [f"{r['stage']}: stage {r['status']} (return code {r['returncode']})" for r in by("stage_end") if r["status"] == "failed"]
    problems += [f"run interrupted after {r['elapsed_s']} s ({r['reason']})" for r in by("interrupted")]
    return dict(run=next(iter(by("run_start")), None), device=device, stages=stages,
                timing=[r for r in cases if r.get("kind") == "timing"], correctness=[r for r in cases if r.get("kind") == "correctness"],
                sdpa=[r for r in cases if r.get("kind") == "sdpa"], skipped_cases=by("case_skipped"),
                budget_stop=next(iter(by("budget_stop")), None), run_end=next(iter(by("run_end")), None), problems=problems)


def _f(x, spec=".3g"):
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _yes(flag) -> str:
    return "-" if flag is None else "yes" if flag else "NO"


def markdown(report: dict) -> str:
    """gpu_check.md: stages, timing (with bandwidth and targets), per-kernel times, SDPA, correctness, skips."""
    lines = _header_lines(report) + _stage_lines(report) + _timing_lines(report) + _kernel_lines(report) + _sdpa_lines(report)
    lines += _correctness_lines(report)
    stop = report["budget_stop"]
    if stop:
        lines += ["", f"**Stopped by the budget** ({stop['budget_s']} s): stages skipped {stop['skipped_stages'] or 'none'}, "
                  f"killed {stop['killed_stage'] or 'none'}, {len(stop['skipped_cases'])} case(s) skipped."]
    if report["problems"]:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


def _header_lines(report: dict) -> list[str]:
    """The title and the run's line: date, device, versions, budget, copy bandwidth."""
    run, dev = report["run"] or {}, report["device"] or {}
    env = dev.get("environment", {})
    return ["# Triton MHLA backend: GPU check", "",
            f"{run.get('date', '?')} on {env.get('device_name', '?')} (torch {env.get('torch', '?')}, triton {env.get('triton', '?')}); "
            f"budget {run.get('budget_s', '?')} s, ran {_f((report['run_end'] or {}).get('elapsed_s'))} s; copy bandwidth "
            f"{_f(dev.get('copy_gbps'), '.0f')} GB/s (read + write), nominal {_f(dev.get('nominal_gbps'), '.0f')} GB/s."
            + (" Interpreter rehearsal: the numbers mean nothing." if env.get("interpret") else ""), ""]


def _stage_lines(report: dict) -> list[str]:
    """The stage table: status, seconds, estimate, compiles beside the plan's, cases done and skipped."""
    lines = ["## Stages", "", "| stage | status | seconds | estimate s | compiles (planned) | compile s | cases | skipped |",
             "|---|---|---|---|---|---|---|---|"]
    for s in report["stages"]:
        if s["type"] == "stage_skipped":
            lines.append(f"| {s['stage']} | skipped: {s['reason']} | | {_f(s.get('estimate_s'))} | | | | |")
            continue
        lines.append(f"| {s['stage']} | {s['status']} | {s['seconds']:.1f} | {_f(s['estimate_s'])} | "
                     f"{s['compiles']} ({s['planned_compiles']}) | {_f(s['compile_s'])} | {s['cases_done']} | {len(s['cases_skipped'])} |")
    return lines


def _timing_lines(report: dict) -> list[str]:
    """The timing table: medians, the graph forward, bandwidth, the floor, targets, determinism."""
    lines = ["", "## Timing (median ms; graph = forward replayed in a CUDA graph)", "",
             "| stage | shape | method | M | fwd | graph fwd | fwd+bwd | fwd GB/s | of copy | x floor | target fwd / fwd+bwd ms | met "
             "| deterministic |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["timing"]:
        if "error" in r:
            lines.append(f"| {r['stage']} | {r['case']} | | | error: {r['error'][:100]} | | | | | | | | |")
            continue
        bw, tgt = r.get("graph_fwd_bw") or r.get("fwd_bw") or {}, r.get("target") or {}
        met = f"{_yes(tgt.get('fwd_met'))} / {_yes(tgt.get('fwdbwd_met'))}" if "fwd_ms" in tgt else "-"
        lines.append(f"| {r['stage']} | {r['shape']} | {r['method']} | {_f(r['num_blocks'])} | {r['fwd_ms']:.3f} | "
                     f"{_f(r.get('graph_ms'), '.3f')} | {r['fwdbwd_ms']:.3f} | {_f(bw.get('gbps'), '.0f')} | "
                     f"{_f(bw.get('of_copy'), '.2f')} | {_f(r.get('fwd_x_floor_at_copy'), '.2f')} | "
                     f"{_f(tgt.get('fwd_ms'), '.3f')} / {_f(tgt.get('fwdbwd_ms'), '.3f')} | {met} | "
                     f"{_yes((r.get('determinism') or {}).get('deterministic'))} |")
    return lines


def _kernel_lines(report: dict) -> list[str]:
    """The per-launch table of the Triton kernels (none when no timing row has kernels)."""
    kernels = [(r, k) for r in report["timing"] for k in r.get("kernels", [])]
    if not kernels:
        return []
    lines = ["", "## Triton kernels (median ms per launch; MB: the bytes model's, else its tensor arguments once)", "",
             "| shape | method | pass | kernel | ms | MB | GB/s | of copy |", "|---|---|---|---|---|---|---|---|"]
    for r, k in kernels:
        bw, nbytes = k.get("model_bw") or k, k.get("model_bytes") or k["bytes"]
        lines.append(f"| {r['shape']} | {r['method']} | {k['pass']} | {k.get('role') or k['kernel']} | {k['ms']:.4f} | "
                     f"{nbytes / 1e6:.1f} | {_f(bw.get('gbps'), '.0f')} | {_f(bw.get('of_copy'), '.2f')} |")
    return lines


def _sdpa_lines(report: dict) -> list[str]:
    """One line per SDPA probe: the backend torch chooses, the one the profiler saw, each backend's forward."""
    lines = []
    for r in report["sdpa"]:
        if "error" in r:
            lines += ["", f"SDPA probe at {r['case']}: error {r['error'][:200]}"]
            continue
        per = ", ".join(f"{name} {_f(b.get('fwd_ms'), '.3f')} ms" if "fwd_ms" in b
                        else f"{name}: {b.get('skipped') or b.get('error', '')[:60]}" for name, b in r["backends"].items())
        lines += ["", f"SDPA at {r['shape']}: torch chooses {r['sdpa'].get('chosen')}, the profiler saw {r['sdpa'].get('ran')}; "
                  f"forward by backend: {per}."]
    return lines


def _correctness_lines(report: dict) -> list[str]:
    """The correctness table: relative errors against the float64 oracle and the torch backend."""
    lines = ["", "## Correctness (relative error vs the float64 oracle; max over out, dq, dk, dv, dmixing)", "",
             "| stage | case | M | d | out | dq | dk | dv | dmixing | vs torch | tol | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["correctness"]:
        if "error" in r:
            lines.append(f"| {r['stage']} | {r['case']} | | | error: {r['error'][:100]} | | | | | | | NO |")
            continue
        e = r["vs_reference"]
        errs = " | ".join(_f(e[k], ".1e") for k in ("out", "dq", "dk", "dv", "dmixing"))
        lines.append(f"| {r['stage']} | {r['case']} | {r['num_blocks']} | {r['d']} | {errs} | {_f(max(r['vs_torch'].values()), '.1e')} | "
                     f"{r['tol']:.0e} | {_yes(r['ok'])} |")
    return lines
