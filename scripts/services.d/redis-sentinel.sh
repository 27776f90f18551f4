# shellcheck shell=bash
# A Redis Sentinel group on loopback, sourced by scripts/services: a primary
# (${JOBS_TEST_SENTINEL_PORT:-6390}), one replica (the next port) and three sentinels
# (${JOBS_TEST_SENTINEL_SENTINEL_PORT:-26390} and the next two) monitoring it as "mymaster",
# quorum 2. Configs, AOFs, logs and pid files live in $svc/redis-sentinel/. Idempotent: a
# process that answers is left alone, one that does not is started from its config file (which
# Redis and the sentinels rewrite after a failover, so a restart rejoins the group as it is now).
# The tests that fail the primary over start groups of their own (bench/chaos/servers.py).

sentinel_dir=$svc/redis-sentinel
sentinel_service=mymaster
sentinel_data_ports=("${JOBS_TEST_SENTINEL_PORT:-6390}" "$((${JOBS_TEST_SENTINEL_PORT:-6390} + 1))")
sentinel_base=${JOBS_TEST_SENTINEL_SENTINEL_PORT:-26390}
sentinel_ports=("$sentinel_base" "$((sentinel_base + 1))" "$((sentinel_base + 2))")
sentinel_addr="127.0.0.1:${sentinel_data_ports[0]}+${sentinel_data_ports[1]}, sentinels ${sentinel_ports[*]}"

sentinel_ping() { [[ $(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null) == PONG ]]; }

# The group is up when every sentinel names a primary that says it is one and has a replica.
sentinel_group_up() {
  local port primary
  for port in "${sentinel_ports[@]}"; do
    primary=$(redis-cli -h 127.0.0.1 -p "$port" sentinel get-master-addr-by-name "$sentinel_service" 2>/dev/null \
      | sed -n 2p) || return 1
    [[ -n $primary ]] || return 1
  done
  redis-cli -h 127.0.0.1 -p "$primary" info replication 2>/dev/null | grep -q '^connected_slaves:[1-9]'
}

# sentinel_start_data PORT [PRIMARY_PORT]: a redis-server (AOF fsynced every second), a replica
# of PRIMARY_PORT when given; its config is written once, then left to Redis.
sentinel_start_data() {
  local conf=$sentinel_dir/redis-$1.conf
  if [[ ! -f $conf ]]; then
    cat >"$conf" <<EOF
port $1
bind 127.0.0.1
dir $sentinel_dir
dbfilename dump-$1.rdb
appendonly yes
appenddirname appendonly-$1
appendfsync everysec
save ""
repl-diskless-sync-delay 0
daemonize yes
pidfile $sentinel_dir/redis-$1.pid
logfile $sentinel_dir/redis-$1.log
EOF
    [[ -z ${2:-} ]] || echo "replicaof 127.0.0.1 $2" >>"$conf"
  fi
  redis-server "$conf" </dev/null >>"$sentinel_dir/start.log" 2>&1
}

sentinel_start_sentinel() {
  local conf=$sentinel_dir/sentinel-$1.conf
  if [[ ! -f $conf ]]; then
    cat >"$conf" <<EOF
port $1
bind 127.0.0.1
dir $sentinel_dir
daemonize yes
pidfile $sentinel_dir/sentinel-$1.pid
logfile $sentinel_dir/sentinel-$1.log
sentinel monitor $sentinel_service 127.0.0.1 ${sentinel_data_ports[0]} 2
sentinel down-after-milliseconds $sentinel_service 1000
sentinel failover-timeout $sentinel_service 5000
EOF
  fi
  redis-server "$conf" --sentinel </dev/null >>"$sentinel_dir/start.log" 2>&1
}

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  down sentinel "$sentinel_addr" "redis-server/redis-cli not found (is Redis installed?)"
elif sentinel_group_up; then
  status sentinel up "$sentinel_addr (already running)"
else
  mkdir -p "$sentinel_dir"
  sentinel_ping "${sentinel_data_ports[0]}" || sentinel_start_data "${sentinel_data_ports[0]}" || true
  sentinel_ping "${sentinel_data_ports[1]}" || sentinel_start_data "${sentinel_data_ports[1]}" "${sentinel_data_ports[0]}" || true
  for sentinel_port in "${sentinel_ports[@]}"; do
    sentinel_ping "$sentinel_port" || sentinel_start_sentinel "$sentinel_port" || true
  done
  if wait_for 30 sentinel_group_up; then
    status sentinel up "$sentinel_addr (started, files: $sentinel_dir)"
  else
    show_log "$sentinel_dir/start.log"
    show_log "$sentinel_dir/sentinel-${sentinel_ports[0]}.log"
    down sentinel "$sentinel_addr" "the group did not agree on a primary with a replica within 30 s (files: $sentinel_dir)"
  fi
fi
