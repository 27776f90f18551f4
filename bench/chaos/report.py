"""Markdown tables from bench/chaos_battery.py JSON reports (for docs/reliability.md).

    python -m bench.chaos.report /tmp/chaos-postgres.json [more.json ...]

One table per backend, one row per figure, one column per report (run) of that backend.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from bench.chaos.attribution import attribute


def _lat(spread: dict[str, Any] | None) -> str:
    if not spread or not spread.get("n"):
        return "n/a (0 samples)"
    return f"{spread['p50']:.2f} / {spread['p99']:.2f} / {spread['max']:.2f} s (n={spread['n']})"


def rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    s = report["scenarios"]
    secs = report.get("scenario_seconds", {})
    if "crash" in s:
        c = s["crash"]
        ch, cl = c["chaos"], c["clean"]
        if len(ch["duplicates"]) == ch["duplicate_jobs"]:
            # Re-attributed with the current rule, so reports from earlier versions agree.
            ch["duplicates_by_cause"] = dict(
                Counter(attribute(d["effects"], ch["event_log"]) for d in ch["duplicates"])
            )
        ev = ch["events"]
        out += [
            ("crash: jobs (sleep) / lease", f"{c['jobs']} ({c['job_ms']:g} ms) / {c['lease_timeout']:g} s"),
            (
                "crash: SIGKILL / SIGSTOP+CONT / server restarts",
                f"{ev.get('kill', 0)} / {ev.get('stop', 0)} / {ev.get('restart', 0)}",
            ),
            ("crash: **jobs lost**", f"**{ch['lost']}** (clean run: {cl['lost']})"),
            (
                "crash: duplicate jobs (extra side effects)",
                f"{ch['duplicate_jobs']} ({ch['duplicate_effects']}); by cause: "
                + (", ".join(f"{k} {v}" for k, v in sorted(ch["duplicates_by_cause"].items())) or "none"),
            ),
            ("crash: stale acks rejected (`lease-lost`)", str(ch["stale_acks_rejected"])),
            ("crash: re-claim latency after SIGKILL p50/p99/max", _lat(ch["recovery_latency_s"].get("kill"))),
            ("crash: re-claim latency after SIGSTOP p50/p99/max", _lat(ch["recovery_latency_s"].get("stop"))),
            ("crash: re-claim latency after a restart p50/p99/max", _lat(ch["recovery_latency_s"].get("restart"))),
            (
                "crash: throughput chaos / clean",
                (
                    f"{ch['throughput_jobs_per_s']} / {cl['throughput_jobs_per_s']} jobs/s "
                    f"(x{c.get('throughput_ratio_chaos_vs_clean')})"
                ),
            ),
            (
                "crash: worker crashes; exit codes on SIGTERM",
                f"{ch['worker_crashes']}; {sorted(set(ch['exit_codes_on_sigterm'].values()))}",
            ),
        ]
    if "poison" in s:
        p = s["poison"]
        kinds = ", ".join(
            f"{k} {v['ended_failed_after_exactly_max_retries_plus_1_runs']}/{v['jobs']}" for k, v in p["poison"].items()
        )
        out += [
            (
                "poison: jobs / poison (max_retries, timeout)",
                f"{p['jobs']} / {p['poison_jobs']} ({p['max_retries']}, {p['poison_timeout_s']} s)",
            ),
            (
                "poison: **failed after exactly max_retries+1 runs**",
                f"**{p['poison_ok']}/{p['poison_jobs']}** ({kinds})",
            ),
            (
                "poison: **healthy jobs failed**",
                (f"**{p['healthy_failed']}** of {p['healthy_jobs']} (duplicates {p['healthy_duplicates']})"),
            ),
            (
                "poison: supervisor restarts (expected)",
                f"{p['supervisor_restarts']} ({p['supervisor_restarts_expected']})",
            ),
        ]
    if "tamper" in s:
        t = s["tamper"]
        out += [
            (
                "tamper: good + bad messages",
                (f"{t['good']} + {t['bad']} ({', '.join(f'{k} {v}' for k, v in t['bad_kinds'].items())})"),
            ),
            (
                "tamper: **bad executed**",
                f"**{t['bad_executed']}** (rejected {t['rejected_total']}: "
                + ", ".join(f"{k} {v}" for k, v in sorted(t["rejected_by_reason"].items()))
                + f"; kept for audit {t['bad_kept_for_audit']})",
            ),
            (
                "tamper: **good completed**",
                f"**{t['good_completed']}/{t['good']}** (duplicates {t['good_duplicates']})",
            ),
            ("tamper: **worker crashes**", f"**{t['worker_crashes']}**"),
            ("tamper: messages/s (start-up included)", str(t["throughput_messages_per_s"])),
        ]
    if "shutdown" in s:
        d = s["shutdown"]
        out += [
            ("shutdown: rounds x 3 workers (SIGTERM to supervisor / to group)", f"{d['rounds']} x 3"),
            ("shutdown: exit codes", "all 0" if d["all_exit_0"] else str(d["exit_codes"])),
            ("shutdown: **leases left after exit**", f"**{d['leases_left_after_exit']}**"),
            (
                "shutdown: in flight at SIGTERM: finished / released / left leased",
                (
                    f"{d['in_flight_at_sigterm']}: {d['in_flight_finished']} / {d['in_flight_released']} / "
                    f"{d['in_flight_left_leased']}"
                ),
            ),
            ("shutdown: runs started after SIGTERM", str(d["runs_started_after_sigterm"])),
            (
                "shutdown: SIGTERM -> exit p50 / max (jobs of 1.5 s)",
                f"{d['exit_latency_s']['p50']:.2f} / {d['exit_latency_s']['max']:.2f} s",
            ),
        ]
    if "soak" in s:
        k = s["soak"]
        growth = [v["growth_kb"] for v in k["worker_rss"].values()]
        first = [v["first_kb"] for v in k["worker_rss"].values()]
        conns = k["pg_connections"] or {}
        out += [
            (
                "soak: duration; max rate; target (70 %)",
                f"{k['seconds']:g} s; {k['max_rate_jobs_per_s']} jobs/s; {k['target_jobs_per_s']} jobs/s",
            ),
            (
                "soak: throughput per 10 s window: mean; CV; min-max",
                (
                    f"{k['throughput_mean']} jobs/s; {k['throughput_cv']}; "
                    f"{min(k['throughput_per_window'], default=0)}-{max(k['throughput_per_window'], default=0)}"
                ),
            ),
            (
                "soak: backlog max; machine load average (1 min) min-max",
                f"{max(k['backlog_samples'], default=0)}; "
                + (
                    f"{min(k['loadavg_samples'])}-{max(k['loadavg_samples'])}"
                    if k.get("loadavg_samples")
                    else "not sampled"
                ),
            ),
            (
                "soak: worker RSS first -> growth",
                f"{min(first) // 1024}-{max(first) // 1024} MiB -> +{min(growth)}..+{max(growth)} KiB"
                if growth
                else "n/a",
            ),
            ("soak: PostgreSQL connections (min-max)", f"{conns.get('min')}-{conns.get('max')}"),
            ("soak: produced / lost / duplicates", f"{k['produced']} / {k['lost']} / {k['duplicates']}"),
            (
                "soak: **final backlog**",
                (f"**{k['final_backlog']}** (at end of production: {k['backlog_at_end_of_production']})"),
            ),
        ]
    if "dbrestart" in s:
        r = s["dbrestart"]
        out.append(
            (
                "dbrestart: jobs per phase (length) / lease / outage",
                f"{r['jobs_per_phase'] - r.get('warmup_jobs_per_phase', 0)} ({r['job_s']:g} s)"
                + (f" + {r['warmup_jobs_per_phase']} warm-up (1 s)" if r.get("warmup_jobs_per_phase") else "")
                + f" / {r['lease_timeout']:g} s / {r['outage_s']:g} s",
            )
        )
        for name, ph in r["phases"].items():
            causes = ", ".join(f"{k} {v}" for k, v in sorted(ph["duplicates_by_cause"].items())) or "none"
            log = ph["worker_log"]
            out += [
                (f"dbrestart {name}: **jobs lost**", f"**{ph['lost']}** of {ph['jobs']}"),
                (
                    f"dbrestart {name}: extra runs; jobs that ran more than once, by cause",
                    f"{ph['duplicate_runs']}; {sum(ph['duplicates_by_cause'].values())} ({causes})",
                ),
                (
                    f"dbrestart {name}: **completed work recorded failed**",
                    f"**{ph['completed_work_recorded_failed']}**",
                ),
                (
                    f"dbrestart {name}: **failures without their failed row** (kept by the broker)",
                    f"**{ph.get('failed_rows_missing', '-')}**"
                    + (
                        f" ({ph['failures_kept_by_the_broker']} kept)"
                        if ph.get("failures_kept_by_the_broker") is not None
                        else ""
                    ),
                ),
                (
                    f"dbrestart {name}: healthy jobs failed; failures blamed on a lost worker",
                    f"{ph.get('ok_jobs_failed', '-')}; {ph.get('fail_late_recorded_with_another_error', '-')}",
                ),
                (f"dbrestart {name}: jobs that ran exactly once", f"{ph['ran_exactly_once']}/{ph['jobs']}"),
                (
                    f"dbrestart {name}: leases reaped; heartbeat failures; stale settles (`lease-lost`)",
                    f"{log['leases_reaped']}; {log['heartbeat_failed_lines']}; {log['lease_lost_settles']}",
                ),
                (
                    f"dbrestart {name}: outage; first run after it",
                    f"{ph['restart']['until'] - ph['restart']['at']:.1f} s; "
                    + (
                        f"{ph['first_run_after_restart_s']:.1f} s"
                        if ph["first_run_after_restart_s"] is not None
                        else "none"
                    ),
                ),
                (
                    f"dbrestart {name}: worker crashes; leases left; exit codes on SIGTERM",
                    f"{ph['worker_crashes']}; {ph['leases_left']}; {sorted(set(ph['exit_codes_on_sigterm'].values()))}",
                ),
            ]
    if "flows" in s:
        out += _flows_rows(s["flows"])
    if "stall" in s:
        out += _stall_rows(s["stall"])
    out.append(("seconds per scenario", ", ".join(f"{k} {v:g}" for k, v in secs.items())))
    return out


def _flows_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    if "skipped" in f:
        return [("flows", f"skipped: {f['skipped']}")]
    expected = f["expected"]
    causes = ", ".join(f"{k} {v}" for k, v in sorted(f["extra_runs_by_cause"].items())) or "none"
    terms = f["terms"]
    exits = [t["exit_s"] for t in terms if t["exit_s"] is not None]
    return [
        (
            "flows: chains x steps + groups x members (+ callback) + late dependents; job sleep / lease",
            (
                f"{f['chains']} x {f['steps']} + {f['groups']} x {f['members']} (+1) + {f['late_dependents']} "
                f"= {f['jobs']} jobs; {f['job_ms']:g} ms / {f['lease_timeout']:g} s"
            ),
        ),
        (
            "flows: designed to fail / settled by a failed parent (expected)",
            f"{f['failed_by_design']} / {f['settled_by_parent']} ({expected.get('parent_failed', 0)})",
        ),
        ("flows: SIGKILL / SIGTERM", f"{f['events'].get('kill', 0)} / {f['events'].get('term', 0)}"),
        (
            "flows: **jobs lost** (not ended as designed)",
            f"**{f['lost']}** of {f['jobs']}" + (f" {f['lost_by_role']}" if f["lost"] else ""),
        ),
        (
            "flows: failed jobs without their `Job` row: written late by the sweep / missing after it",
            f"{f.get('failed_rows_written_late', '-')} / {f.get('failed_rows_missing', '-')}",
        ),
        (
            "flows: **started before their parents finished**",
            (
                f"**{f['out_of_order']}** (chains in order {f['chains_in_order']}/{f['chains']}, "
                f"callbacks after their group {f['groups_in_order']}/{f['groups']})"
            ),
        ),
        (
            "flows: callbacks completed / run more than once",
            f"{f['callbacks_completed']}/{f['callbacks']} / {f['callbacks_run_more_than_once']}",
        ),
        (
            "flows: **callbacks released twice** / re-run after their worker was killed",
            f"**{f['callbacks_released_twice']}** / {f['callbacks_rerun_after_kill']}",
        ),
        ("flows: extra runs (all jobs), by cause", f"{f['extra_runs']} ({causes})"),
        (
            "flows: release latency p50/p99/max: chain step; callback; late dependent",
            "; ".join(_lat(f["release_latency_s"][role]) for role in ("step", "callback", "late")),
        ),
        (
            "flows: SIGTERMed workers: exit codes; SIGTERM -> exit max; runs started after SIGTERM",
            f"{f['term_exit_codes']}; {max(exits):.2f} s; {f['runs_started_after_sigterm']}"
            if exits
            else "none stopped",
        ),
        ("flows: throughput; wall", f"{f['throughput_jobs_per_s']} jobs/s; {f['wall_s']:g} s"),
        (
            "flows: worker crashes; leases left; exit codes on SIGTERM",
            f"{f['worker_crashes']}; {f['leases_left']}; {sorted(set(f['exit_codes_on_sigterm'].values()))}",
        ),
    ]


def _stall_rows(t: dict[str, Any]) -> list[tuple[str, str]]:
    groups, (low, high), freezes, aimed = t["jobs_by_max_retries"], t["job_ms"], t["freezes"], t["aimed_runs"]
    causes = ", ".join(f"{k} {v}" for k, v in sorted(t["uncounted_reruns_by_cause"].items())) or "none"
    log = t["worker_log"]
    return [
        (
            "stall: jobs (max_retries 0 / 2); job sleep / lease / freeze",
            (
                f"{t['jobs']} ({groups['0']} / {groups['2']}); {low:g}-{high:g} ms / {t['lease_timeout']:g} s / "
                f"{t['freeze_s']:g} s"
            ),
        ),
        (
            f"stall: freezes aimed (runs >= {t['min_run_age_s']:g} s old) / blind; aimed that found no run",
            f"{freezes.get('aimed', 0)} / {freezes.get('blind', 0)}; {t['aimed_missed']}",
        ),
        (
            "stall: aimed freezes' runs: lost and counted / **lost uncounted** / kept",
            f"{aimed['lost_counted']} / **{aimed['lost_uncounted']}** / {aimed['kept']}",
        ),
        (
            "stall: **jobs lost** (completed; failed `WorkerLost`)",
            f"**{t['lost']}** of {t['jobs']} ({t['completed']}; {t['failed_worker_lost']})",
        ),
        (
            "stall: **uncounted re-runs not explained by a blind freeze** (all, by cause)",
            f"**{t['uncounted_reruns_not_blind']}** ({t['uncounted_reruns']}: {causes})",
        ),
        (
            "stall: **jobs called over max_retries + 1 times, not by a blind freeze** (all)",
            f"**{t['calls_over_budget_not_blind']}** ({t['calls_over_budget']})",
        ),
        ("stall: handler calls; leases reaped", f"{t['handler_calls']}; {log['leases_reaped']}"),
        (
            "stall: worker crashes; leases left; exit codes on SIGTERM",
            f"{t['worker_crashes']}; {t['leases_left']}; {sorted(set(t['exit_codes_on_sigterm'].values()))}",
        ),
        ("stall: wall", f"{t['wall_s']:g} s"),
    ]


def tables(reports: list[dict[str, Any]]) -> str:
    """One table per backend; one column per report of that backend (e.g. two sizes)."""
    out = []
    backends = list(dict.fromkeys(r["backend"] for r in reports))
    for backend in backends:
        mine = [r for r in reports if r["backend"] == backend]
        columns = [dict(rows(r)) for r in mine]
        names = list(dict.fromkeys(name for r in mine for name, _ in rows(r)))
        out.append(f"**{backend}**")
        out.append("")
        for i, r in enumerate(mine, 1):
            out.append(
                f"{i}. `{r['command']}` (django_jobs {r.get('django_jobs_commit')}, {r['started_utc']}, "
                f"load average {r['machine']['loadavg_before'][0]:.1f}"
                f" before, {r['machine']['loadavg_after'][0]:.1f} after)"
                + (f"; errors: {', '.join(r['errors'])}" if r.get("errors") else "")
            )
        out.append("")
        out.append("| figure | " + " | ".join(f"run {i}" for i in range(1, len(mine) + 1)) + " |")
        out.append("|---|" + "---|" * len(mine))
        for name in names:
            out.append(f"| {name} | " + " | ".join(c.get(name, "-") for c in columns) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    loaded = []
    for path in sys.argv[1:]:
        with open(path) as f:
            loaded.append(json.load(f))
    print(tables(loaded))
