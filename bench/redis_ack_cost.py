"""What job dependencies cost the Redis ack of a job that has none: the ack script as it is
against the ack script of a baseline commit, on the same server, in one run.

Every ack of a parent checks whether jobs depend on it (``HEXISTS dependents id``), and every
script gets three more keys. This measures both ways of looking at it, for acks of leased jobs
with no dependents (the hot path):

- **round trip**: one ``EVALSHA`` per ack from this process, as a worker acks (µs per ack);
- **server**: the microseconds Redis itself spent per ack (``INFO commandstats``), which the
  round trip hides.

Blocks of acks alternate between the two scripts so that drift on a shared machine hits both
alike. By default it starts a private ``redis-server`` on a Unix socket (no other client skews
``commandstats``) and stops it at the end; ``--url`` uses a running server instead (its
``commandstats`` are reset). It quotes ratios; nothing asserts on time.

    python bench/redis_ack_cost.py [--acks 20000] [--block 1000] [--baseline REF] [--url URL]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from django_jobs.backends.redis import QueueKeys, _source

# The last commit before job dependencies: its ack.lua and common.lua are the baseline.
BASELINE = "f1dbd8c"
LUA = "django_jobs/backends/lua"
# Keys of that commit's QueueKeys (the ones before dependents, finished, blocked).
BASELINE_KEYS = 12


def baseline_source(ref: str) -> str:
    def show(name: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:{LUA}/{name}"], check=True, capture_output=True, text=True
        ).stdout

    return show("common.lua") + "\n" + show("ack.lua")


def private_server(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    """A throwaway redis-server on a Unix socket, persisting nothing."""
    socket = os.path.join(workdir, "redis.sock")
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", socket, "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(unix_socket_path=socket)
    for _ in range(100):
        try:
            client.ping()
            return server, f"unix://{socket}"
        except redis.ConnectionError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit("redis-server did not start")


def lease_block(client: Any, keys: QueueKeys, fetch: Any, count: int) -> list[tuple[str, str]]:
    """Enqueue ``count`` jobs and lease them: (id, owner) pairs ready to ack."""
    pipe = client.pipeline(transaction=False)
    ids = [secrets.token_hex(16) for _ in range(count)]
    for job_id in ids:
        pipe.hset(keys.bodies, job_id, b'{"v":1}')
        pipe.hset(keys.priorities, job_id, 0)
        pipe.zadd(keys.waiting, {job_id: 0})
    pipe.execute()
    owner, now = secrets.token_hex(16), int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    for _ in ids:
        fetch(keys=list(keys), args=[now, now + 600_000, owner], client=pipe)
    return [(reply[0].decode(), owner) for reply in pipe.execute()]


def server_usec(client: Any) -> float:
    stats = client.info("commandstats")
    return float(stats.get("cmdstat_evalsha", {}).get("usec", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--acks", type=int, default=20000, help="acks per script (default 20000)")
    parser.add_argument("--block", type=int, default=1000, help="acks per alternating block (default 1000)")
    parser.add_argument("--baseline", default=BASELINE, help=f"git ref of the baseline scripts (default {BASELINE})")
    parser.add_argument("--url", help="a running Redis to use instead of a private redis-server")
    opts = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="ackcost-")
    server = None
    try:
        if opts.url:
            url = opts.url
        else:
            server, url = private_server(workdir)
        client = redis.Redis.from_url(url)
        keys = QueueKeys.of(f"ackcost{os.getpid()}", "default")
        fetch = client.register_script(_source("fetch"))
        variants = {
            "baseline": (client.register_script(baseline_source(opts.baseline)), list(keys)[:BASELINE_KEYS], []),
            "dependencies": (client.register_script(_source("ack")), list(keys), ["completed"]),
        }
        seconds = dict.fromkeys(variants, 0.0)
        usec = dict.fromkeys(variants, 0.0)
        done = 0
        while done < opts.acks:
            size = min(opts.block, opts.acks - done)
            for name, (script, script_keys, extra) in variants.items():
                pairs = lease_block(client, keys, fetch, size)
                client.config_resetstat()
                start = time.perf_counter()
                for job_id, owner in pairs:
                    assert script(keys=script_keys, args=[job_id, owner, *extra]) == 1
                seconds[name] += time.perf_counter() - start
                usec[name] += server_usec(client)
            done += size
        leftover = list(client.scan_iter(match=f"{keys.waiting.split(':')[0]}:*"))
        if leftover:
            client.delete(*leftover)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)

    info = f"{opts.acks} acks per script, blocks of {opts.block}, baseline {opts.baseline}, redis {url}"
    print(info)
    print(f"{'':<14}{'round trip µs/ack':>20}{'server µs/ack':>16}")
    for name in variants:
        print(f"{name:<14}{seconds[name] / opts.acks * 1e6:>20.2f}{usec[name] / opts.acks:>16.2f}")
    trip = seconds["dependencies"] / seconds["baseline"]
    served = usec["dependencies"] / usec["baseline"] if usec["baseline"] else float("nan")
    print(f"{'ratio':<14}{trip:>20.3f}{served:>16.3f}")


if __name__ == "__main__":
    main()
