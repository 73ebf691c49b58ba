# shellcheck shell=bash
# Test hosts on one machine: network namespaces joined by a switch, and
# mpirun jobs launched across them over TCP, for the tests of what fails
# between machines (sourced, not run):
#
#   source "$1"             # $(location //tools/testing:netns_hosts)
#   hosts_init 4 || exit 0  # 4 hosts, or a SKIP line where not permitted
#   hosts_mpirun 4 2 "$fsdp" train --backend=mpi ...  # 4 hosts, 2 ranks each
#   hosts_link 1 down       # cut host 1's link (up: restore it)
#   hosts_loss 1 10         # host 1 loses 10% of its packets (off: stop)
#   hosts_finish            # also runs on exit
#
# What it makes, and nothing else: a switch namespace with a bridge, and
# per host a namespace with a veth to the bridge (addresses 10.77.0.1+i/24,
# used only inside these namespaces), all named with a random tag, removed
# at exit. A job's rank 0 and mpirun run on host 0; mpirun starts the other
# hosts' daemons through an agent (--mca plm_rsh_agent) that runs them in
# the host's namespace, as ssh would on a real machine. The file system is
# the machine's, shared by every host, but each host has its own TMPDIR and
# its own local disk at $hosts_disk (hosts_disk_of I: host I's, seen from
# outside).
#
# The launch flags that bound the job's end across machines (the README's
# "Reliability" section recommends them): TCP keepalives of a few seconds
# on the daemons' connections (oob_tcp_keepalive_*; without them Open MPI's
# launcher waits minutes for a daemon behind a cut link after the ranks
# themselves have ended; 5 probes a second apart, so that a lossy link is
# not taken for a cut one), and SIGKILL at once when the job is aborted
# (odls_base_sigkill_timeout 0; by default a remote daemon's SIGTERM-then-
# SIGKILL sequence added 3 s here).

# hosts_init N: makes N hosts; returns 1 (printing SKIP and why) where the
# machine does not allow it (not root, no `ip`, no network namespaces).
hosts_init() {
  hosts_n=$1
  # Bazel's test environment leaves the administrator's tools (tc) out.
  PATH="$PATH:/usr/sbin:/sbin"
  hosts_tag=$(printf 'fp%04x' $((RANDOM % 65536)))
  hosts_dir=${TEST_TMPDIR:-$(mktemp -d)}/hosts
  mkdir -p "$hosts_dir"
  if [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null 2>&1 ||
    ! command -v nft >/dev/null 2>&1; then
    echo "SKIP: test hosts need root, iproute2's ip (network namespaces) and nft (tools/setup.sh installs both)"
    return 1
  fi
  if ! ip netns add "${hosts_tag}sw" 2>"$hosts_dir/err"; then
    echo "SKIP: cannot make a network namespace here: $(cat "$hosts_dir/err")"
    return 1
  fi
  trap hosts_finish EXIT
  ip -n "${hosts_tag}sw" link add br0 type bridge || return 1
  ip -n "${hosts_tag}sw" link set br0 up || return 1
  : >"$hosts_dir/map"
  local i ns
  for i in $(seq 0 $((hosts_n - 1))); do
    ns="${hosts_tag}h$i"
    ip netns add "$ns" || return 1
    ip link add "${hosts_tag}e$i" type veth peer name "${hosts_tag}p$i" ||
      return 1
    ip link set "${hosts_tag}e$i" netns "$ns" || return 1
    ip link set "${hosts_tag}p$i" netns "${hosts_tag}sw" || return 1
    ip -n "$ns" link set "${hosts_tag}e$i" name eth0 || return 1
    ip -n "$ns" addr add "$(hosts_ip "$i")/24" dev eth0 || return 1
    ip -n "$ns" link set lo up || return 1
    ip -n "$ns" link set eth0 up || return 1
    ip -n "${hosts_tag}sw" link set "${hosts_tag}p$i" master br0 || return 1
    ip -n "${hosts_tag}sw" link set "${hosts_tag}p$i" up || return 1
    echo "$(hosts_ip "$i") $ns" >>"$hosts_dir/map"
    mkdir -p "$hosts_dir/disk-$ns"
  done
  # A host's shell: in its network namespace (and the mount namespace `ip
  # netns exec` makes), with its own TMPDIR (the daemons share topology
  # files there) and $hosts_dir/disk bound to its own local disk
  # $hosts_dir/disk-NS: "hostshell.sh NS COMMAND_STRING".
  hosts_disk="$hosts_dir/disk"
  mkdir -p "$hosts_disk"
  cat >"$hosts_dir/hostshell.sh" <<EOF
#!/bin/bash
mkdir -p "$hosts_dir/tmp-\$1" "$hosts_dir/disk-\$1"
mount --bind "$hosts_dir/disk-\$1" "$hosts_dir/disk" || exit 1
TMPDIR="$hosts_dir/tmp-\$1" exec /bin/sh -c "\$2"
EOF
  # The agent mpirun runs instead of ssh: "agent HOST COMMAND...".
  cat >"$hosts_dir/agent.sh" <<EOF
#!/bin/bash
ns=\$(awk -v h="\$1" '\$1 == h { print \$2 }' "$hosts_dir/map")
shift
[ -n "\$ns" ] || { echo "agent: unknown host" >&2; exit 1; }
exec ip netns exec "\$ns" "$hosts_dir/hostshell.sh" "\$ns" "\$*"
EOF
  chmod +x "$hosts_dir/agent.sh" "$hosts_dir/hostshell.sh"
  echo "hosts: $hosts_n namespaces ${hosts_tag}h0..$((hosts_n - 1)) on bridge ${hosts_tag}sw"
}

hosts_ip() { echo "10.77.0.$(($1 + 1))"; }
hosts_disk_of() { echo "$hosts_dir/disk-$(hosts_ns "$1")"; }
hosts_ns() { echo "${hosts_tag}h$1"; }

# hosts_mpirun HOSTS RANKS_PER_HOST PROGRAM ARGS...: runs one job over
# hosts 0..HOSTS-1, rank r on host r / RANKS_PER_HOST; bounded by
# $HOSTS_MPIRUN_LIMIT_S (default 120) times FLATPARAM_TEST_TIME_SCALE with
# `timeout`.
hosts_mpirun() {
  local hosts=$1 per_host=$2
  shift 2
  local hostlist="" i
  for i in $(seq 0 $((hosts - 1))); do
    hostlist+="${hostlist:+,}$(hosts_ip "$i"):$per_host"
  done
  local mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none
    -np $((per_host * hosts)) --host "$hostlist"
    --mca plm_rsh_agent "$hosts_dir/agent.sh"
    --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24
    --mca oob_tcp_if_include 10.77.0.0/24
    --mca oob_tcp_keepalive_time 1 --mca oob_tcp_keepalive_intvl 1
    --mca oob_tcp_keepalive_probes 5 --mca odls_base_sigkill_timeout "${HOSTS_SIGKILL_TIMEOUT_S:-0}"
    -x ASAN_OPTIONS "$@")
  local command
  printf -v command '%q ' "${mpirun[@]}"
  ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}" \
    timeout --kill-after=10 \
    $((${HOSTS_MPIRUN_LIMIT_S:-120} * ${FLATPARAM_TEST_TIME_SCALE:-1})) \
    ip netns exec "$(hosts_ns 0)" "$hosts_dir/hostshell.sh" "$(hosts_ns 0)" \
    "exec $command"
}

# hosts_link I up|down: restores or cuts host I's link to the switch. On
# restoring, every host forgets the neighbour entries the cut left failed,
# which would otherwise fail the next job's first connections to host I.
hosts_link() {
  ip -n "${hosts_tag}sw" link set "${hosts_tag}p$1" "$2"
  [ "$2" = up ] || return 0
  local i
  for i in $(seq 0 $((hosts_n - 1))); do
    ip -n "$(hosts_ns "$i")" neigh flush all 2>/dev/null
  done
}

# hosts_loss I PERCENT: host I's link drops PERCENT % of the packets it
# sends and of those it receives, at random; hosts_loss I off stops it.
# With nftables (tc's netem is missing from some kernels, this machine's
# among them).
hosts_loss() {
  local ns
  ns=$(hosts_ns "$1")
  ip netns exec "$ns" nft delete table inet fploss 2>/dev/null
  [ "$2" != off ] || return 0
  ip netns exec "$ns" nft -f - <<EOF
table inet fploss {
  chain in { type filter hook input priority 0; numgen random mod 100 < $2 drop; }
  chain out { type filter hook output priority 0; numgen random mod 100 < $2 drop; }
}
EOF
}

# hosts_pids [I]: the live processes in host I's namespace (every host's
# without I), one pid per line; zombies excluded.
hosts_pids() {
  local hosts pid i
  hosts=${1:-$(seq 0 $((hosts_n - 1)))}
  for i in $hosts; do
    for pid in $(ip netns pids "$(hosts_ns "$i")" 2>/dev/null); do
      [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ] ||
        echo "$pid"
    done
  done
}

# hosts_wait_empty SECONDS: waits until no process runs on any host (the
# launcher's daemons end shortly after the job); returns 1 if some still
# run after SECONDS.
hosts_wait_empty() {
  local deadline=$((SECONDS + $1))
  while [ -n "$(hosts_pids)" ]; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

# hosts_rank_pid R: the pid of the job's rank R (from its environment).
hosts_rank_pid() {
  local pid
  for pid in $(hosts_pids); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null |
      grep -qx "OMPI_COMM_WORLD_RANK=$1"; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

# hosts_finish: kills what still runs on the hosts and removes them.
hosts_finish() {
  [ -n "${hosts_tag:-}" ] || return 0
  local pids i
  pids=$(hosts_pids)
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
  for i in $(seq 0 $((hosts_n - 1))); do
    ip netns del "${hosts_tag}h$i" 2>/dev/null
  done
  ip netns del "${hosts_tag}sw" 2>/dev/null
  hosts_tag=""
}
