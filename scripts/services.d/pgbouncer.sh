# shellcheck shell=bash
# PgBouncer in transaction pooling mode, on 127.0.0.1:${JOBS_TEST_PGBOUNCER_PORT:-6432}, in front
# of the test PostgreSQL (127.0.0.1:5432, trust): every database name maps to the same name there.
# Sourced by scripts/services (its helpers status, down, wait_for, show_log and $svc). Debian's
# pgbouncer is installed with apt-get if missing and run as a process of its own (not the system
# service): its config, auth file, pid file and log live in .services/pgbouncer/ (another port:
# .services/pgbouncer-PORT/). It refuses to run as root: as root it runs as the postgres user
# (and its files go to /tmp/django-jobs-pgbouncer-PORT/ where postgres cannot reach .services/).

pgb_port=${JOBS_TEST_PGBOUNCER_PORT:-6432}
pgb_addr=127.0.0.1:$pgb_port
pgb_dir=$svc/pgbouncer
[[ $pgb_port == 6432 ]] || pgb_dir=$svc/pgbouncer-$pgb_port

# Is it PgBouncer? Its admin console (database "pgbouncer") answers SHOW VERSION.
pgbouncer_up() {
  psql "host=127.0.0.1 port=$pgb_port dbname=pgbouncer user=postgres connect_timeout=2" -Atc 'SHOW VERSION' 2>/dev/null |
    grep -q PgBouncer
}
pgbouncer_port_open() {
  timeout 2 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$pgb_port" >/dev/null 2>&1
}

install_pgbouncer() {
  local log=$svc/apt-pgbouncer.log
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y pgbouncer </dev/null >>"$log" 2>&1 && return 0
  apt-get update </dev/null >>"$log" 2>&1 && apt-get install -y pgbouncer </dev/null >>"$log" 2>&1 && return 0
  show_log "$log"
  return 1
}

start_pgbouncer() {
  # As root it runs as postgres, which must reach its files: where a parent of the repository
  # is closed to other users (a clone under /root), they go to a directory in /tmp instead.
  if ((EUID == 0)) && ! runuser -u postgres -- test -x "$svc" 2>/dev/null; then
    pgb_dir=/tmp/django-jobs-pgbouncer-$pgb_port
  fi
  mkdir -p "$pgb_dir"
  # Transaction pooling: a server connection is the client's for one transaction only (no
  # session state survives: no LISTEN, no session advisory lock, no prepared statement kept).
  # The small pools keep the shared server's max_connections for everyone else; ten per test
  # database serve a session's workers. No Unix socket: the port alone is the instance's.
  cat >"$pgb_dir/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $pgb_port
unix_socket_dir =
auth_type = trust
auth_file = $pgb_dir/userlist.txt
admin_users = postgres
pool_mode = transaction
default_pool_size = 10
max_client_conn = 500
logfile = $pgb_dir/pgbouncer.log
pidfile = $pgb_dir/pgbouncer.pid
INI
  printf '"postgres" ""\n' >"$pgb_dir/userlist.txt"
  local user=()
  if ((EUID == 0)); then
    chown -R postgres: "$pgb_dir"
    user=(-u postgres)
  fi
  # A pgbouncer we started earlier that no longer answers: stop it (its own pid file only).
  if [[ -f $pgb_dir/pgbouncer.pid ]]; then
    local old_pid
    old_pid=$(<"$pgb_dir/pgbouncer.pid")
    if [[ $old_pid =~ ^[0-9]+$ && $(cat "/proc/$old_pid/comm" 2>/dev/null || true) == pgbouncer ]]; then
      kill "$old_pid" 2>/dev/null || true
      sleep 0.5
    fi
    rm -f "$pgb_dir/pgbouncer.pid"
  fi
  # -d: it detaches by itself (and writes its pid file), so it outlives this script.
  pgbouncer -d "${user[@]}" "$pgb_dir/pgbouncer.ini" </dev/null >>"$pgb_dir/start.log" 2>&1
}

if pgbouncer_up; then
  status pgbouncer up "$pgb_addr (already running)"
elif pgbouncer_port_open; then
  down pgbouncer "$pgb_addr" "the port is taken by something that is not PgBouncer; set JOBS_TEST_PGBOUNCER_PORT to a free port"
elif ! command -v pgbouncer >/dev/null 2>&1 && ! install_pgbouncer; then
  down pgbouncer "$pgb_addr" "pgbouncer is not installed and 'apt-get install -y pgbouncer' failed (log: $svc/apt-pgbouncer.log)"
elif ! start_pgbouncer; then
  show_log "$pgb_dir/start.log"
  down pgbouncer "$pgb_addr" "pgbouncer did not start (log: $pgb_dir/start.log)"
elif wait_for 15 pgbouncer_up; then
  status pgbouncer up "$pgb_addr (started, transaction pooling, pid $(<"$pgb_dir/pgbouncer.pid"), log: $pgb_dir/pgbouncer.log)"
else
  show_log "$pgb_dir/pgbouncer.log"
  down pgbouncer "$pgb_addr" "pgbouncer did not answer within 15 s (log: $pgb_dir/pgbouncer.log)"
fi
