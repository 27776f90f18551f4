#!/usr/bin/env python
"""django-jobs beside its peers, in one run of the shared anchors harness: ratio tables and a chart.

    python bench/compare.py                                  # core drain, every peer, harness defaults
    python bench/compare.py --rounds 1 --n 5000              # one round of N=5000 per cell
    python bench/compare.py --quick --only raw-pg,pgqueuer,djjobs-pg   # plumbing check, ~1-2 min
    python bench/compare.py --variants core,w2,retry --out /tmp/compare.md
    python bench/compare.py --from-results bench/results/anchors-20250101-120000.jsonl   # no run
    python bench/compare.py --only djjobs-pg --pg-port 6432  # PostgreSQL through PgBouncer

It runs the anchors harness (``run.sh`` in ``--anchors``, default ``$BENCH_ANCHORS`` or
``../shared/bench-anchors``) with ``BENCH_DJANGO_JOBS_SRC`` set to this repository, so the
harness installs the working tree into its own venv and adds the ``djjobs-*`` cells to every
peer it knows.  It then reads that run's ``results.jsonl`` (copied to
``bench/results/anchors-<run time>.jsonl``) and prints, per engine (PostgreSQL, SQLite, Redis,
beanstalkd), a markdown table of drain and enqueue jobs/s with the ratio django-jobs ÷ peer,
paired within each round of the same run; the w2 and retry variants get their own tables when
measured.  Finally it draws drain jobs/s per system, grouped by engine, as a PNG
(``docs/images/bench-drain.png``; matplotlib from bench/requirements.txt).

``--from-results PATH`` skips the run and re-reads an existing results.jsonl: that is how the
tables and the chart are regenerated.  Nothing here asserts on time; it is not a test.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
DEFAULT_CHART = REPO / "docs" / "images" / "bench-drain.png"
DJJOBS = "django-jobs"
DJJOBS_CELLS = ("djjobs-pg", "djjobs-sqlite", "djjobs-redis", "djjobs-beanstalk")
PEER_CELLS = (
    "raw-pg",
    "djdb-pg",
    "procrastinate",
    "pgqueuer",
    "pgqueuer-c1",
    "oban",
    "oban-limit10",
    "djdb-sqlite",
    "raw-redis",
    "huey",
    "dramatiq-prefetch100",
    "rq-simple",
    "celery",
    "raw-beanstalkd",
)
ENGINES = ("PostgreSQL", "SQLite", "Redis", "beanstalkd")
VARIANTS = ("core", "w2", "retry")
W2_NOTE = (
    "2 workers ÷ 1 worker divides a variant cell by the core cell of the same round: the variant's N is "
    "smaller, so worker start-up weighs more in the 2-worker figure."
)
RUN_DIR_LINE = re.compile(r"raw results -> (\S+results\.jsonl)")
RUN_STAMP = re.compile(r"(\d{8}-\d{6})")


class CompareError(Exception):
    """A problem worth one line on stderr and an exit status, not a traceback."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


# --- results -------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One successful measurement: one system on one engine, one variant, one round."""

    variant: str
    round: int
    system: str
    backend: str
    n: int
    enqueue_rate: float | None
    enqueue_mode: str
    drain_rate: float

    @property
    def key(self) -> tuple[str, str]:
        return (self.system, self.backend)


@dataclass
class Results:
    """The rows of one harness run, its failed or skipped cells, and where they came from."""

    path: Path
    rows: list[Row] = field(default_factory=list)
    failures: list[dict[str, object]] = field(default_factory=list)
    rounds: int = 0

    def of(self, variant: str, backend: str | None = None) -> list[Row]:
        return [r for r in self.rows if r.variant == variant and backend in (None, r.backend)]

    def run_time(self) -> dt.datetime:
        """When the run started: the harness's ``run-YYYYmmdd-HHMMSS`` stamp, else the file's mtime."""
        for name in (self.path.name, self.path.parent.name):
            if match := RUN_STAMP.search(name):
                return dt.datetime.strptime(match.group(1), "%Y%m%d-%H%M%S")
        return dt.datetime.fromtimestamp(self.path.stat().st_mtime)


def load_results(path: Path) -> Results:
    if not path.is_file():
        raise CompareError(f"no results file at {path}", status=2)
    results = Results(path=path)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        results.rounds = max(results.rounds, int(raw.get("round", 0)))
        if "error" in raw or raw.get("drain_rate") is None:
            results.failures.append(raw)
            continue
        results.rows.append(
            Row(
                variant=raw["variant"],
                round=int(raw["round"]),
                system=raw["system"],
                backend=raw["backend"],
                n=int(raw["n"]),
                enqueue_rate=raw.get("enqueue_rate"),
                enqueue_mode=raw.get("enqueue_mode", "single"),
                drain_rate=float(raw["drain_rate"]),
            )
        )
    return results


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def drain_median(rows: list[Row], key: tuple[str, str]) -> float | None:
    return median(r.drain_rate for r in rows if r.key == key)


def paired_ratio(num: list[Row], den: list[Row], num_key: tuple[str, str], den_key: tuple[str, str]) -> float | None:
    """Median over rounds of drain(num_key) / drain(den_key), both measured in the same round."""
    num_by_round = {r.round: r.drain_rate for r in num if r.key == num_key}
    den_by_round = {r.round: r.drain_rate for r in den if r.key == den_key}
    return median(num_by_round[k] / den_by_round[k] for k in num_by_round.keys() & den_by_round.keys())


def systems_in_order(rows: list[Row]) -> list[tuple[str, str]]:
    """Raw limits first, then the fastest drain first."""
    keys = {r.key for r in rows}
    return sorted(keys, key=lambda k: (not k[0].startswith("raw "), -(drain_median(rows, k) or 0.0), k[0]))


# --- markdown --------------------------------------------------------------------


def fmt_rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def enqueue_cell(rows: list[Row], key: tuple[str, str]) -> str:
    mine = [r for r in rows if r.key == key]
    text = fmt_rate(median(r.enqueue_rate for r in mine))
    return f"{text} (bulk)" if mine and all(r.enqueue_mode == "bulk" for r in mine) else text


def drain_table(results: Results, variant: str, engine: str, rate_header: str) -> list[str]:
    """One engine's table for the core or retry variant: rates and django-jobs ÷ each system."""
    rows = results.of(variant, engine)
    if not rows:
        return []
    ours = (DJJOBS, engine)
    has_ours = any(r.key == ours for r in rows)
    lines = [
        f"| system | {rate_header} | enqueue jobs/s | {DJJOBS} ÷ system | rounds ok |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in systems_in_order(rows):
        name = f"**{key[0]}**" if key == ours else key[0]
        ratio = "–" if key == ours or not has_ours else fmt_ratio(paired_ratio(rows, rows, ours, key))
        ok = sum(1 for r in rows if r.key == key)
        lines.append(
            f"| {name} | {fmt_rate(drain_median(rows, key))} | {enqueue_cell(rows, key)} | {ratio} "
            f"| {ok}/{results.rounds} |"
        )
    return lines


def w2_table(results: Results, engine: str) -> list[str]:
    """One engine's 2-worker table: 2 workers ÷ 1 worker per system, and django-jobs ÷ each system."""
    w2 = results.of("w2", engine)
    if not w2:
        return []
    core = results.of("core", engine)
    ours = (DJJOBS, engine)
    has_ours = any(r.key == ours for r in w2)
    lines = [
        (
            "| system | drain jobs/s, 2 workers | drain jobs/s, 1 worker (core) | 2 workers ÷ 1 worker "
            f"| {DJJOBS} ÷ system (2 workers) |"
        ),
        "|---|---:|---:|---:|---:|",
    ]
    for key in systems_in_order(w2):
        name = f"**{key[0]}**" if key == ours else key[0]
        ratio = "–" if key == ours or not has_ours else fmt_ratio(paired_ratio(w2, w2, ours, key))
        lines.append(
            f"| {name} | {fmt_rate(drain_median(w2, key))} | {fmt_rate(drain_median(core, key))} "
            f"| {fmt_ratio(paired_ratio(w2, core, key, key))} | {ratio} |"
        )
    return lines


def n_of(rows: list[Row]) -> str:
    sizes = sorted({r.n for r in rows})
    return "/".join(str(n) for n in sizes) if sizes else "?"


def markdown(results: Results) -> str:
    when = results.run_time().strftime("%Y-%m-%d %H:%M")
    out = [
        f"## django-jobs beside the anchors ({when}, {results.rounds} round(s))",
        "",
        (
            f"Source: `{results.path}`. Medians over rounds; every ratio is paired: computed within one round "
            "of this run, then the median taken. drain = N / (worker spawn → N-th job done), one worker "
            "process with one slot unless stated."
        ),
        "",
    ]
    sections = [
        ("core", "Drain", "drain jobs/s, 1 worker"),
        ("retry", "Retry (every job fails once, zero delay; each job = 2 attempts)", "retry jobs/s"),
    ]
    for variant, title, header in sections:
        for engine in ENGINES:
            if table := drain_table(results, variant, engine, header):
                out += [f"### {title}: {engine}, N={n_of(results.of(variant, engine))}", "", *table, ""]
        if variant == "core":
            for engine in ENGINES:
                if table := w2_table(results, engine):
                    n = n_of(results.of("w2", engine))
                    title = f"### 2 workers (1 slot each): {engine}, N={n}"
                    out += [title, "", W2_NOTE, "", *table, ""]
    if results.failures:
        out += ["### Failed or skipped cells", ""]
        for raw in results.failures:
            error = " ".join(str(raw.get("error", "no drain rate")).split())[:200]
            out.append(f"- round {raw.get('round')} {raw.get('cell')} [{raw.get('variant')}]: {error}")
        out.append("")
    return "\n".join(out)


# --- chart -----------------------------------------------------------------------


def draw_chart(results: Results, path: Path) -> None:
    """Horizontal bars of core drain jobs/s, one panel per engine, django-jobs highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(engine, systems_in_order(results.of("core", engine))) for engine in ENGINES]
    panels = [(engine, keys) for engine, keys in panels if keys]
    if not panels:
        raise CompareError(f"no core drain rows in {results.path}: nothing to chart")
    colours = {"ours": "#d62728", "peer": "#4c72b0", "raw": "#b0b0b0"}
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(10, 1.2 + 0.42 * sum(len(keys) + 1.5 for _, keys in panels)),
        gridspec_kw={"height_ratios": [len(keys) + 1.5 for _, keys in panels]},
        squeeze=False,
    )
    for ax, (engine, keys) in zip(axes[:, 0], panels, strict=True):
        rows = results.of("core", engine)
        values = [drain_median(rows, key) or 0.0 for key in keys]
        kinds = ["ours" if k[0] == DJJOBS else "raw" if k[0].startswith("raw ") else "peer" for k in keys]
        labels = [bar_label(rows, key) for key in keys]
        bars = ax.barh(labels, values, color=[colours[k] for k in kinds], edgecolor="black", linewidth=0.4)
        ax.invert_yaxis()
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=3, fontsize=8)
        ax.set_xlim(0, max(values) * 1.15 or 1)
        ax.set_ylabel(engine, fontweight="bold")
        ax.set_xlabel("drain jobs/s (1 worker, 1 slot)", fontsize=8)
        ax.tick_params(axis="both", labelsize=8)
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        ax.set_axisbelow(True)
        for tick, kind in zip(ax.get_yticklabels(), kinds, strict=True):
            if kind == "ours":
                tick.set_fontweight("bold")
    core = results.of("core")
    fig.suptitle(
        f"Drain throughput, one worker: django-jobs beside its peers\n"
        f"{results.run_time():%Y-%m-%d}, N={n_of(core)}, {results.rounds} round(s) (median); "
        "each engine has its own scale",
        fontsize=11,
    )
    fig.legend(
        handles=[
            Patch(color=colours[k], label=label)
            for k, label in (("ours", DJJOBS), ("peer", "peer"), ("raw", "raw backend loop (physical limit)"))
        ],
        loc="lower center",
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_label(rows: list[Row], key: tuple[str, str]) -> str:
    """The system's name, with its N when the harness capped it below the others'."""
    sizes = {r.n for r in rows if r.key == key}
    capped = max(sizes) < max(r.n for r in rows)
    return f"{key[0]} (N={max(sizes)})" if capped else key[0]


# --- running the harness ---------------------------------------------------------


def anchors_dir(given: str | None) -> Path:
    """--anchors, else $BENCH_ANCHORS, else ../shared/bench-anchors next to the repository."""
    path = Path(given or os.environ.get("BENCH_ANCHORS") or REPO.parent / "shared" / "bench-anchors")
    if not (path / "run.sh").is_file():
        raise CompareError(
            f"no anchors harness (run.sh) in {path}: pass --anchors DIR or set BENCH_ANCHORS "
            "to the bench-anchors checkout (or use --from-results PATH to re-read a results.jsonl)",
            status=2,
        )
    return path.resolve()


def harness_argv(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    argv = ["--variants", args.variants, "--budget", str(args.budget)]
    argv += ["--only", args.only or ",".join(PEER_CELLS + DJJOBS_CELLS)]
    if args.quick:
        argv.append("--quick")
    if args.rounds is not None:
        argv += ["--rounds", str(args.rounds)]
    if args.n is not None:
        argv += ["--n", str(args.n)]
    return argv + passthrough


def compile_for_harness(anchors: Path, env: dict[str, str]) -> None:
    """Compile django-jobs' modules for the harness venv's Python, as ``pip install`` does for a
    wheel. The harness installs this checkout editable; where ``PYTHONDONTWRITEBYTECODE`` is set,
    every worker start would otherwise compile django-jobs from source while the peers load theirs
    compiled. ``run.sh --list`` makes the venv and installs the checkout first."""
    subprocess.run([str(anchors / "run.sh"), "--list"], cwd=anchors, env=env, stdout=subprocess.DEVNULL, check=True)
    python = Path(os.environ.get("BENCH_VENV", "/tmp/benchvenv")) / "bin" / "python"
    subprocess.run([str(python), "-m", "compileall", "-q", str(REPO / "django_jobs")], check=True)


def run_harness(anchors: Path, argv: list[str], pg_port: str | None = None) -> Path:
    """Run run.sh (its progress lines pass through to stderr); return the results.jsonl it wrote.
    ``pg_port``: the PostgreSQL port the harness uses (``BENCH_PG_PORT``)."""
    tmp_root = Path(os.environ.get("BENCH_TMP", "/tmp/bench_anchors"))
    env = {**os.environ, "BENCH_DJANGO_JOBS_SRC": str(REPO)}
    if pg_port:
        env["BENCH_PG_PORT"] = pg_port
    compile_for_harness(anchors, env)
    cmd = [str(anchors / "run.sh"), *argv]
    log(f"$ BENCH_DJANGO_JOBS_SRC={REPO} {' '.join(cmd)}")
    started = time.time()
    reported: Path | None = None
    with subprocess.Popen(
        cmd, cwd=anchors, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            if match := RUN_DIR_LINE.search(line):
                reported = Path(match.group(1))
    found = reported or newest_run(tmp_root, started)
    if found is None or not found.is_file():
        raise CompareError(f"the harness exited {proc.returncode} without a results.jsonl", status=1)
    if proc.returncode != 0:
        log(f"warning: the harness exited {proc.returncode}; reading what it wrote to {found}")
    log(f"harness report: {found.parent / 'report.md'}")
    return found


def newest_run(tmp_root: Path, started: float) -> Path | None:
    """The results.jsonl of the newest run-* directory created after ``started``, if any."""
    runs = [p for p in tmp_root.glob("run-*/results.jsonl") if p.parent.stat().st_mtime >= started - 1]
    return max(runs, key=lambda p: p.parent.stat().st_mtime, default=None)


def keep_copy(results_file: Path) -> Path:
    stamp = RUN_STAMP.search(results_file.parent.name)
    name = stamp.group(1) if stamp else time.strftime("%Y%m%d-%H%M%S")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    dest = RESULTS_DIR / f"anchors-{name}.jsonl"
    shutil.copyfile(results_file, dest)
    return dest


def git_state() -> str:
    def git(*argv: str) -> str:
        proc = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=False)
        return proc.stdout.strip()

    dirty = " + uncommitted changes" if git("status", "--porcelain", "--", "django_jobs") else ""
    return f"{git('rev-parse', '--short', 'HEAD') or '?'}{dirty}"


# --- command line ----------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other option is passed to the harness's run.py unchanged (e.g. --drain-timeout 300).",
    )
    parser.add_argument("--anchors", help="bench-anchors directory (default $BENCH_ANCHORS or ../shared/bench-anchors)")
    parser.add_argument("--rounds", type=int, help="rounds (harness default 3)")
    parser.add_argument("--n", type=int, help="jobs per core cell (harness default 5000)")
    parser.add_argument("--quick", action="store_true", help="harness smoke test: 1 round, N=500 (variants 200)")
    parser.add_argument("--only", default="", help="comma list of harness system ids (default: all peers + djjobs-*)")
    parser.add_argument("--variants", default="core", help="comma list of core,w2,retry (default core)")
    parser.add_argument("--budget", type=float, default=3600, help="harness time budget, s (default 3600)")
    parser.add_argument("--from-results", type=Path, help="re-read this results.jsonl instead of running")
    parser.add_argument("--chart", type=Path, default=DEFAULT_CHART, help="PNG path (default %(default)s)")
    parser.add_argument("--no-chart", action="store_true", help="tables only")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    parser.add_argument(
        "--pg-port",
        help="the harness's PostgreSQL port (its BENCH_PG_PORT; default 5432): e.g. 6432, PgBouncer in "
        "transaction mode in front of it (scripts/services), to measure the PostgreSQL cells through the pooler",
    )
    args, passthrough = parser.parse_known_args(argv)
    if passthrough and args.from_results:
        parser.error(f"--from-results runs nothing: {' '.join(passthrough)} would be ignored")
    if bad := [v for v in args.variants.split(",") if v.strip() not in VARIANTS]:
        parser.error(f"unknown variant(s) {bad}; choose from {','.join(VARIANTS)}")
    return args, passthrough


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse_args(argv)
    try:
        if args.from_results:
            results_file = args.from_results
        else:
            anchors = anchors_dir(args.anchors)
            log(f"django-jobs under test: {REPO} at {git_state()}")
            results_file = run_harness(anchors, harness_argv(args, passthrough), args.pg_port)
            log(f"results kept in {keep_copy(results_file)}")
        results = load_results(results_file)
        text = markdown(results)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        if not args.no_chart:
            draw_chart(results, args.chart)
            log(f"chart written to {args.chart}")
    except CompareError as exc:
        log(f"compare.py: {exc}")
        return exc.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
