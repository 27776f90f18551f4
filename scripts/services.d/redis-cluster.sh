# shellcheck shell=bash
# Sourced by scripts/services (helpers: status, down, wait_for, show_log; $svc for files).
#
# A Redis Cluster of 3 primaries on loopback ports ${JOBS_TEST_REDIS_CLUSTER_PORT:-7000},
# +1 and +2 (the test suite's Redis Cluster; no replicas: the tests that kill a primary start
# their own cluster). Each node keeps its nodes.conf, log and pid file in .services/redis-cluster/
# PORT/; nothing is persisted (tests own their data). A cluster that already answers
# "cluster_state:ok" on its first port is left alone.

cluster_first=${JOBS_TEST_REDIS_CLUSTER_PORT:-7000}
cluster_ports=("$cluster_first" "$((cluster_first + 1))" "$((cluster_first + 2))")
cluster_dir=$svc/redis-cluster
cluster_addr=127.0.0.1:$cluster_first

cluster_ok() {
  [[ $(redis-cli -h 127.0.0.1 -p "$cluster_first" cluster info 2>/dev/null | tr -d '\r' | grep '^cluster_state:') == cluster_state:ok ]]
}
node_up() { [[ $(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null) == PONG ]]; }
# Slots this node serves or knows about (0 on a node that never joined a cluster).
node_slots() {
  redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_slots_assigned://p'
}

start_cluster_node() {
  local port=$1 dir=$cluster_dir/$1
  mkdir -p "$dir"
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --cluster-enabled yes \
    --cluster-config-file nodes.conf --cluster-node-timeout 2000 --save "" --appendonly no \
    --dir "$dir" --logfile "$dir/redis.log" --pidfile "$dir/redis.pid" \
    </dev/null >>"$cluster_dir/start.log" 2>&1 || true
}

# Stop a node this part started earlier (its own pid file, and only if it is a redis-server).
stop_cluster_node() {
  local pidfile=$cluster_dir/$1/redis.pid pid
  [[ -f $pidfile ]] || return 0
  pid=$(<"$pidfile")
  if [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null || true) == redis-server ]]; then
    kill "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  rm -f "$pidfile"
}

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  down redis-cluster "$cluster_addr" "redis-cli/redis-server not found (is Redis installed?)"
elif cluster_ok; then
  status redis-cluster up "127.0.0.1:${cluster_ports[0]}-${cluster_ports[2]} (already running)"
else
  mkdir -p "$cluster_dir"
  # A node of an earlier, broken cluster (half created, or a node lost) is started afresh: the
  # suite keeps nothing in it.
  for port in "${cluster_ports[@]}"; do
    if node_up "$port" && [[ $(node_slots "$port") != 0 ]]; then
      stop_cluster_node "$port"
      rm -f "$cluster_dir/$port/nodes.conf"
    fi
  done
  for port in "${cluster_ports[@]}"; do
    node_up "$port" || { rm -f "$cluster_dir/$port/nodes.conf"; start_cluster_node "$port"; }
  done
  all_up=true
  for port in "${cluster_ports[@]}"; do
    wait_for 15 node_up "$port" || { all_up=false; show_log "$cluster_dir/$port/redis.log"; }
  done
  if ! $all_up; then
    show_log "$cluster_dir/start.log"
    down redis-cluster "$cluster_addr" "a cluster node did not answer PING within 15 s (logs: $cluster_dir/PORT/redis.log)"
  else
    redis-cli --cluster create "${cluster_ports[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes \
      </dev/null >>"$cluster_dir/create.log" 2>&1 || true
    if wait_for 20 cluster_ok; then
      status redis-cluster up "127.0.0.1:${cluster_ports[0]}-${cluster_ports[2]} (started 3 primaries, files: $cluster_dir)"
    else
      show_log "$cluster_dir/create.log"
      down redis-cluster "$cluster_addr" "redis-cli --cluster create did not reach cluster_state:ok within 20 s (log: $cluster_dir/create.log)"
    fi
  fi
fi
