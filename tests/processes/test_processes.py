"""Acceptance tests with real worker processes on PostgreSQL: ``manage.py jobs_work`` and
``jobs_reap`` run as subprocesses, receive real signals, crash, and are counted by their side
effects (one ``SideEffect`` row per run, written by ``tests.testapp.jobs.scripted`` in the
``postgres`` database, with the pid of the process that ran it).

Helpers (starting, signalling, polling with deadlines, killing in ``finally``) live in
``tests/procs.py``.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest
from django.db import connections
from django.utils import timezone

from django_jobs import Jobs
from django_jobs.models import Job
from tests.procs import START_LINE, STOP_LINE, pid_alive, processes, wait_until, worker_env
from tests.testapp.jobs import scripted, scripted_async
from tests.testapp.models import SideEffect

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def dispatch(action: str = "ok", *, key: str | None = None, **options) -> str:
    """One scripted job on the pg backend that records its runs in PostgreSQL."""
    kwargs = {"action": action, "key": key, "db": PG}
    for name in ("seconds", "fail_times"):
        if name in options:
            kwargs[name] = options.pop(name)
    return scripted.using(backend="pg", **options).dispatch(**kwargs)


def job(job_id: str) -> Job:
    return Job.objects.using(PG).get(pk=job_id)


def effects(key: str) -> list[SideEffect]:
    return list(SideEffect.objects.using(PG).filter(key=key).order_by("id"))


def settled(*job_ids: str) -> bool:
    """True once none of these jobs is pending or in progress."""
    return not Job.objects.using(PG).filter(pk__in=job_ids, status__in=["pending", "in_progress"]).exists()


# -- 1. concurrency -----------------------------------------------------------------------------


@pytest.mark.slow
def test_three_worker_processes_run_3000_jobs_exactly_once():
    """Three separate ``jobs_work`` processes drain one queue: SKIP LOCKED claims mean no job is
    run twice and none is left behind."""
    total = 3000
    prefix = unique("bulk")
    with processes() as procs:
        env = worker_env()
        # Start (and wait for) all three first, so they compete for the same rows.
        workers = [procs.worker("--backend", "pg", env=env, wait_started=False) for _ in range(3)]
        for worker in workers:
            worker.wait_started()
        ids = Jobs.bulk(
            [scripted.using(backend="pg").builder(action="ok", key=f"{prefix}-{i}", db=PG) for i in range(total)],
            backend="pg",
        )
        assert len(set(ids)) == total

        def done() -> bool:
            for worker in workers:
                assert worker.alive(), f"a worker died mid-drain\n{worker.output()}"
            return Job.objects.using(PG).filter(pk__in=ids, status="completed").count() == total

        wait_until(done, 75, f"{total} completed jobs", interval=0.2)
        # Stop as soon as the queue is drained: SIGTERM is a clean stop, exit status 0.
        for worker in workers:
            worker.send(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
        assert codes == [0, 0, 0], "\n".join(w.output() for w in workers)

    jobs = Job.objects.using(PG).filter(pk__in=ids)
    assert jobs.count() == total
    assert jobs.filter(status="completed", attempts=1).count() == total
    runs = SideEffect.objects.using(PG).filter(key__startswith=prefix + "-")
    assert runs.count() == total, "some job ran more than once or not at all"
    assert runs.values("key").distinct().count() == total
    # Every run was reported exactly once across the three processes' outputs.
    acked = [line.split()[1] for worker in workers for line in worker.job_lines("completed")]
    assert sorted(acked) == sorted(ids)
    # The work was really shared: runs came from more than one process, and every supervisor
    # reported some of them (each forks one worker process).
    pids = set(runs.values_list("pid", flat=True))
    assert len(pids) > 1, f"every job ran in one process: {pids}"
    assert all(worker.job_lines("completed") for worker in workers), [len(w.job_lines("completed")) for w in workers]


@pytest.mark.slow
def test_concurrency_option_forks_processes_that_share_the_queue():
    """``--concurrency 3``: one supervisor, three forked worker processes, still exactly once."""
    total = 300
    prefix = unique("conc")
    with processes() as procs:
        worker = procs.worker("--backend", "pg", "--concurrency", "3", env=worker_env())
        assert "concurrency=3" in worker.wait_started()
        ids = Jobs.bulk(
            [scripted.using(backend="pg").builder(action="ok", key=f"{prefix}-{i}", db=PG) for i in range(total)],
            backend="pg",
        )
        wait_until(lambda: settled(*ids), 45, f"{total} settled jobs")
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    assert Job.objects.using(PG).filter(pk__in=ids, status="completed", attempts=1).count() == total
    runs = SideEffect.objects.using(PG).filter(key__startswith=prefix + "-")
    assert runs.count() == total
    assert runs.values("key").distinct().count() == total
    pids = set(runs.values_list("pid", flat=True))
    assert worker.pid not in pids, "jobs must run in the forked processes, not in the supervisor"
    assert len(pids) > 1, f"every job ran in one forked process: {pids}"
    assert sorted(line.split()[1] for line in worker.job_lines("completed")) == sorted(ids)


# -- 2. a crashed worker's lease is recovered by jobs_reap ----------------------------------------


@pytest.mark.slow
def test_sigkilled_worker_leaves_a_lease_that_jobs_reap_recovers():
    """SIGKILL (no chance to clean up) mid-job: the row stays in progress until its lease
    expires; ``jobs_reap`` requeues it as one lost run; a fresh worker then completes it.

    The job sleeps 3 s on every run: long enough to be killed mid-run (the kill follows its
    SideEffect row within a poll interval), short enough for the second run to finish quickly.
    """
    env = worker_env(lease_timeout=2)
    key = unique("crash")
    job_id = dispatch("sleep", key=key, seconds=3, max_retries=1)
    with processes() as procs:
        # One job at a time: it is started as it is claimed, so its lost lease is a lost run.
        # (Claimed ahead in a batch, it would go back uncounted: tested below.)
        first = procs.worker("--backend", "pg", "--prefetch", "1", env=env)
        [run] = wait_until(lambda: effects(key), 30, "the first run to start")
        # The supervisor and its forked worker process die together, as on a host crash or
        # the OOM killer: nobody is left to settle the job or to restart a worker.
        first.send(signal.SIGKILL, group=True)
        assert first.wait(10) == -signal.SIGKILL
        wait_until(lambda: not pid_alive(run.pid), 10, f"worker process {run.pid} to die")

        row = job(job_id)
        assert (row.status, row.attempts) == ("in_progress", 0)
        assert row.owner_token and row.leased_until is not None

        wait_until(lambda: job(job_id).leased_until < timezone.now(), 10, "the dead worker's lease to expire")
        code, reap = procs.run("jobs_reap", "--backend", "pg", env=env)
        assert code == 0, reap.output()
        assert reap.out == ["reaped 1 expired lease(s)"], reap.output()

        row = job(job_id)
        assert (row.status, row.attempts) == ("pending", 1), "the lost run counts as a failed run"
        assert row.owner_token is None and row.leased_until is None
        assert row.last_error.startswith("WorkerLost: lease expired"), row.last_error

        # A fresh worker started only now: jobs_reap, not this worker's own reaping, recovered it.
        code, second = procs.run("jobs_work", "--backend", "pg", "--once", env=env, timeout=30)
        assert code == 0, second.output()
        assert len(second.job_lines("completed")) == 1 and job_id in second.job_lines("completed")[0], second.output()

    row = job(job_id)
    assert (row.status, row.attempts) == ("completed", 2)
    runs = effects(key)
    assert len(runs) == 2
    assert runs[0].pid != runs[1].pid


# -- 3. a job that kills its worker every time ------------------------------------------------------


@pytest.mark.slow
def test_job_that_kills_its_worker_every_time_fails_after_max_retries_plus_one_deliveries():
    """``os._exit`` in the job: the supervisor replaces the process and recovers the claims it
    held, counting the job it had in hand as a lost run, so the job ends failed instead of
    killing workers forever."""
    key = unique("exit")
    job_id = dispatch("exit", key=key, max_retries=2, backoff={"strategy": "none"})
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env(lease_timeout=1))
        wait_until(lambda: job(job_id).status == "failed", 40, "the job to end failed", interval=0.1)
        # The supervisor itself survived three dead worker processes and still stops cleanly.
        assert worker.alive(), worker.output()
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    row = job(job_id)
    assert row.attempts == 3
    assert row.last_error.startswith("WorkerLost: lease expired"), row.last_error
    runs = effects(key)
    assert len(runs) == 3, "exactly max_retries + 1 deliveries"
    assert len({r.pid for r in runs}) == 3, "each delivery killed its process; a new one took over"
    assert sum("died with status 3" in line for line in worker.err) == 3, worker.output()


@pytest.mark.slow
def test_a_worker_process_that_dies_mid_batch_counts_only_its_job_in_hand():
    """With batches (the default PREFETCH), a dying worker process holds jobs it claimed ahead.
    Its supervisor recovers them at once, not a lease timeout (60 s here) later: the job it was
    running counts a lost run, and the ones it never started go back uncounted and run once."""
    killer_key, keys = unique("exit"), [unique("after") for _ in range(4)]
    killer = dispatch("exit", key=killer_key, max_retries=0, priority=10)  # claimed first
    others = [dispatch("ok", key=key) for key in keys]
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env())
        wait_until(lambda: settled(killer, *others), 30, "every job to settle", interval=0.1)
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    row = job(killer)
    assert (row.status, row.attempts) == ("failed", 1), "its one run, lost, used up max_retries=0"
    assert row.last_error.startswith("WorkerLost"), row.last_error
    assert len(effects(killer_key)) == 1
    assert [(job(i).status, job(i).attempts) for i in others] == [("completed", 1)] * 4
    assert [len(effects(key)) for key in keys] == [1] * 4


@pytest.mark.slow
def test_a_host_crash_mid_batch_counts_the_started_job_and_hands_the_others_back_uncounted():
    """Supervisor and worker SIGKILLed together (a host crash): nobody recovers the claims
    until their leases expire. The job that was running had its start recorded (with the
    batch's next write), so ``jobs_reap`` counts its lost run (``max_retries=0``: failed); the
    jobs claimed ahead and never started go back uncounted, marked so that each one's start is
    recorded before it runs again; a fresh worker then runs them once each."""
    env = worker_env(lease_timeout=2)
    keys = [unique("batch") for _ in range(3)]
    ids = [dispatch("sleep", key=key, seconds=3, max_retries=0) for key in keys]
    with processes() as procs:
        first = procs.worker("--backend", "pg", env=env)
        [run] = wait_until(lambda: effects(keys[0]), 30, "the first job to start")
        wait_until(lambda: job(ids[0]).claimed_ahead == 0, 10, "the first job's start to be recorded")
        first.send(signal.SIGKILL, group=True)
        assert first.wait(10) == -signal.SIGKILL
        wait_until(lambda: not pid_alive(run.pid), 10, f"worker process {run.pid} to die")
        assert [(job(i).status, job(i).claimed_ahead) for i in ids] == [("in_progress", 0)] + [("in_progress", 1)] * 2

        wait_until(lambda: job(ids[0]).leased_until < timezone.now(), 10, "the dead worker's leases to expire")
        code, reap = procs.run("jobs_reap", "--backend", "pg", env=env)
        assert code == 0, reap.output()
        assert (job(ids[0]).status, job(ids[0]).attempts) == ("failed", 1)
        assert job(ids[0]).last_error.startswith("WorkerLost"), job(ids[0]).last_error
        assert [(job(i).status, job(i).attempts, job(i).claimed_ahead) for i in ids[1:]] == [("pending", 0, 2)] * 2

        code, second = procs.run("jobs_work", "--backend", "pg", "--max", "2", env=env, timeout=60)
        assert code == 0, second.output()

    assert [(job(i).status, job(i).attempts, job(i).claimed_ahead) for i in ids[1:]] == [("completed", 1, 0)] * 2
    assert [len(effects(key)) for key in keys] == [1, 1, 1]


# -- 4. graceful shutdown, --once, --max ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "group"),
    [
        (signal.SIGTERM, False),  # what a service manager or ``docker stop`` sends to the main process
        (signal.SIGINT, True),  # ^C in a terminal: the whole foreground process group gets it
    ],
    ids=["SIGTERM-to-supervisor", "SIGINT-to-process-group"],
)
def test_stop_signal_finishes_the_running_job_then_exits_0(signum, group):
    running_key, queued_key = unique("running"), unique("queued")
    running = dispatch("sleep", key=running_key, seconds=2, priority=10)
    queued = dispatch("ok", key=queued_key)
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env())
        wait_until(lambda: effects(running_key), 30, "the sleeping job to start")
        worker.send(signum, group=group)
        if signum == signal.SIGTERM:  # a second SIGTERM changes nothing (only a SIGINT stops at once)
            time.sleep(0.2)
            worker.send(signum, group=group)
        assert worker.wait(30) == 0, worker.output()

    # The job in hand was finished, not abandoned or interrupted ...
    row = job(running)
    assert (row.status, row.attempts) == ("completed", 1), row.last_error
    assert [line.split()[:2] for line in worker.job_lines()] == [["completed", running]], worker.output()
    # ... nothing was left leased ...
    assert not Job.objects.using(PG).filter(status="in_progress").exists()
    # ... and no new job was taken after the signal.
    assert job(queued).status == "pending"
    assert effects(queued_key) == []


SIGINT_NOTICE = "SIGINT again to stop at once"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("group", "args"),
    [(False, ()), (True, ()), (False, ("--once",))],
    ids=["SIGINT-to-supervisor", "SIGINT-to-process-group", "once-in-the-command-process"],
)
def test_a_second_sigint_stops_at_once_and_hands_the_running_job_back_uncounted(group, args):
    key, queued_key = unique("interrupted"), unique("queued")
    hanging = dispatch("hang", key=key, priority=10)
    queued = dispatch("ok", key=queued_key)
    with processes() as procs:
        worker = procs.worker("--backend", "pg", *args, env=worker_env())
        wait_until(lambda: effects(key), 30, "the hanging job to start")
        worker.send(signal.SIGINT, group=group)
        wait_until(lambda: any(SIGINT_NOTICE in line for line in worker.err), 30, "the first SIGINT's notice")
        assert worker.alive() and job(hanging).status == "in_progress", worker.output()  # it waits for the job
        worker.send(signal.SIGINT, group=group)
        assert worker.wait(20) == 0, worker.output()

    # The run was interrupted and handed back: due again, no run counted, and said so.
    row = job(hanging)
    assert (row.status, row.attempts) == ("pending", 0), worker.output()
    assert row.last_error.startswith("WorkerInterrupted: the worker was stopped at once"), row.last_error
    assert [line.split()[:2] for line in worker.job_lines()] == [["interrupted", hanging]], worker.output()
    assert any(f"job {hanging}" in line and "interrupted" in line for line in worker.err), worker.output()
    assert not Job.objects.using(PG).filter(status="in_progress").exists()
    assert (len(effects(key)), effects(queued_key), job(queued).status) == (1, [], "pending")


@pytest.mark.slow
def test_a_second_sigint_kills_a_process_whose_job_no_signal_reaches_and_recovers_the_job():
    key = unique("deaf")
    stuck = dispatch("hang_masked", key=key, max_retries=1)
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env())
        wait_until(lambda: effects(key), 30, "the stuck job to start")
        worker.send(signal.SIGINT)
        wait_until(lambda: any(SIGINT_NOTICE in line for line in worker.err), 30, "the first SIGINT's notice")
        worker.send(signal.SIGINT)
        assert worker.wait(30) == 0, worker.output()
    assert any("after the second SIGINT; killing it" in line for line in worker.err), worker.output()
    row = job(stuck)  # recovered at once as a lost run, as after any death of a worker process
    assert (row.status, row.attempts) == ("pending", 1), worker.output()
    assert "WorkerLost" in row.last_error, row.last_error


@pytest.mark.slow
def test_stop_signal_right_after_the_start_line_exits_0():
    """Signals are honoured from the moment the start line is printed (an idle worker)."""
    with processes() as procs:
        worker = procs.worker("--backend", "pg", "--concurrency", "2", env=worker_env())
        assert worker.stop(signal.SIGTERM) == 0, worker.output()
    assert worker.job_lines() == []


@pytest.mark.slow
def test_once_runs_one_job_and_exits_0():
    ids = [dispatch("ok", key=unique("once"), priority=p) for p in (2, 1)]
    with processes() as procs:
        code, worker = procs.run("jobs_work", "--backend", "pg", "--once", env=worker_env(), timeout=30)
    assert code == 0, worker.output()
    assert worker.out[0].startswith(START_LINE), worker.output()
    assert [line.split()[:2] for line in worker.job_lines()] == [["completed", ids[0]]], worker.output()
    assert worker.out[-1].startswith(f"{STOP_LINE}: process {worker.pid}, 1 deliveries in "), worker.output()
    assert worker.out[-1].endswith(": 1 completed"), worker.output()
    assert [job(i).status for i in ids] == ["completed", "pending"]


@pytest.mark.slow
def test_once_with_an_empty_queue_exits_0():
    with processes() as procs:
        code, worker = procs.run("jobs_work", "--backend", "pg", "--once", env=worker_env(), timeout=30)
    assert code == 0, worker.output()
    assert worker.out[0].startswith(START_LINE) and worker.job_lines() == [], worker.output()
    assert worker.out[1].startswith(f"{STOP_LINE}: process {worker.pid}, 0 deliveries"), worker.output()


@pytest.mark.slow
def test_max_n_runs_n_jobs_and_exits_0():
    ids = [dispatch("ok", key=unique("max"), priority=5 - i) for i in range(5)]
    with processes() as procs:
        code, worker = procs.run("jobs_work", "--backend", "pg", "--max", "3", env=worker_env(), timeout=30)
    assert code == 0, worker.output()
    assert worker.out[0].startswith(START_LINE), worker.output()
    assert [line.split()[:2] for line in worker.job_lines()] == [["completed", i] for i in ids[:3]], worker.output()
    assert [job(i).status for i in ids] == ["completed"] * 3 + ["pending"] * 2


# -- 5. timeouts --------------------------------------------------------------------------------


@pytest.mark.slow
def test_soft_timeout_fails_the_attempt_and_the_worker_carries_on():
    """``hang`` sleeps in Python: SIGALRM interrupts it with JobTimeout inside the same process."""
    hang_key, ok_key = unique("hang"), unique("after-hang")
    hang = dispatch("hang", key=hang_key, timeout=1, priority=10)
    ok = dispatch("ok", key=ok_key)
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env())
        wait_until(lambda: settled(hang, ok), 30, "both jobs to settle", interval=0.1)
        assert worker.alive(), worker.output()
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    row = job(hang)
    assert (row.status, row.attempts) == ("failed", 1)
    assert row.last_error.startswith("JobTimeout: "), row.last_error
    assert (job(ok).status, job(ok).attempts) == ("completed", 1)
    # The same process ran both: a soft timeout costs no restart.
    assert effects(hang_key)[0].pid == effects(ok_key)[0].pid
    assert not any("died with status" in line for line in worker.err), worker.output()


@pytest.mark.slow
def test_hard_timeout_settles_a_stuck_job_and_replaces_the_process():
    """``hang_masked`` blocks SIGALRM (a C call that never returns): the heartbeat thread
    settles it as failed after the grace period and ends the process; the supervisor starts a
    fresh one, which runs the next job."""
    stuck_key, ok_key = unique("stuck"), unique("after-stuck")
    stuck = dispatch("hang_masked", key=stuck_key, timeout=1, priority=10)
    ok = dispatch("ok", key=ok_key)
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env())
        wait_until(lambda: settled(stuck, ok), 30, "both jobs to settle", interval=0.1)
        assert worker.alive(), worker.output()
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    row = job(stuck)
    assert (row.status, row.attempts) == ("failed", 1)
    assert row.last_error.startswith("JobTimeout: "), row.last_error
    assert (job(ok).status, job(ok).attempts) == ("completed", 1)
    [stuck_run], [ok_run] = effects(stuck_key), effects(ok_key)
    assert stuck_run.pid != ok_run.pid, "the stuck process must have been replaced"
    assert not pid_alive(stuck_run.pid)
    assert any("died with status 75" in line for line in worker.err), worker.output()


@pytest.mark.slow
def test_async_jobs_run_to_their_end_under_their_soft_and_hard_timeouts():
    """``async def`` jobs: one blocks its event loop past its timeout (only the hard timeout ends
    it, with its process); one awaits past its timeout (JobTimeout reaches it where it awaits,
    and its process carries on); one writes with the async ORM."""
    block_key, nap_key, ok_key = unique("async-block"), unique("async-nap"), unique("async")
    block = scripted_async.using(backend="pg", timeout=0.5, max_retries=0, priority=10).dispatch(
        action="block", seconds=60, key=block_key, db=PG
    )
    nap = scripted_async.using(backend="pg", timeout=0.5, max_retries=0, priority=5).dispatch(
        action="sleep", seconds=60, key=nap_key, db=PG
    )
    ok = scripted_async.using(backend="pg").dispatch(key=ok_key, db=PG)
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env())
        wait_until(lambda: settled(block, nap, ok), 30, "the three jobs to settle", interval=0.1)
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    assert job(block).last_error.startswith("JobTimeout: attempt exceeded its timeout by 2s and was killed")
    assert job(nap).last_error.startswith("JobTimeout: attempt exceeded its 0.5s timeout"), job(nap).last_error
    assert [job(i).status for i in (block, nap, ok)] == ["failed", "failed", "completed"]
    assert [len(effects(key)) for key in (nap_key, f"{nap_key}:interrupted:JobTimeout", ok_key)] == [1, 1, 1]
    [blocked], [napped], [done] = effects(block_key), effects(nap_key), effects(ok_key)
    assert blocked.pid != napped.pid == done.pid, "a soft timeout costs no restart; the hard one does"
    assert any("died with status 75" in line for line in worker.err), worker.output()


# -- 6. bad input never stops a worker ------------------------------------------------------------


def tamper(job_id: str, sql_set: str, params: list) -> None:
    """Change a stored row behind the library's back, as someone with database access could."""
    with connections[PG].cursor() as cursor:
        cursor.execute(f"UPDATE django_jobs_job SET {sql_set} WHERE id = %s", [*params, job_id])
        assert cursor.rowcount == 1


@pytest.mark.slow
def test_tampered_unsigned_and_unknown_jobs_are_rejected_while_good_ones_run():
    good_keys = [unique("good") for _ in range(5)]
    bad_key = unique("bad")
    # Priorities interleave good and bad deliveries in fetch order.
    good = [dispatch("ok", key=k, priority=100 - 20 * i) for i, k in enumerate(good_keys)]
    payload_changed = dispatch("ok", key=bad_key, priority=90)
    tamper(payload_changed, "payload = %s::jsonb", ['{"args": [], "kwargs": {"action": "exit"}}'])
    nonsense_signature = dispatch("ok", key=bad_key, priority=70)
    tamper(nonsense_signature, "signature = %s", ["not-a-signature"])
    moved_queue = dispatch("ok", key=bad_key, priority=50)
    tamper(moved_queue, "queue = %s", ["other"])  # the signature binds it to "default"
    unknown_handler = (
        Jobs.define("tests.testapp.jobs.no_such_job", {"args": [], "kwargs": {}}).priority(30).dispatch(backend="pg")
    )
    bad = [payload_changed, nonsense_signature, moved_queue, unknown_handler]

    with processes() as procs:
        worker = procs.worker("default", "other", "--backend", "pg", env=worker_env())
        wait_until(lambda: settled(*good, *bad), 30, "every job to settle", interval=0.1)
        assert worker.alive(), worker.output()
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    for job_id in good:
        assert (job(job_id).status, job(job_id).attempts) == ("completed", 1)
    for job_id in bad:
        row = job(job_id)
        assert (row.status, row.attempts) == ("failed", 0), job_id
        assert row.last_error.startswith("rejected:"), row.last_error
    assert "BadSignature" in job(payload_changed).last_error
    assert "BadSignature" in job(nonsense_signature).last_error
    assert "BadSignature" in job(moved_queue).last_error
    assert "HandlerNotAllowed" in job(unknown_handler).last_error
    # Nothing bad ran; every good job ran once, all in the one worker process (never replaced).
    assert effects(bad_key) == []
    runs = SideEffect.objects.using(PG).filter(key__in=good_keys)
    assert runs.count() == len(good)
    assert runs.values("pid").distinct().count() == 1
    assert len(worker.job_lines("rejected")) == len(bad), worker.output()
    assert not any("died with status" in line for line in worker.err), worker.output()
