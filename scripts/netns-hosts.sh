#!/usr/bin/env bash
# Several emulated hosts on one machine: Linux network namespaces on a bridge (needs root and
# iproute2). The same layout as crates/flotilla/tests/support/netns.rs:
#
#   host i = namespace ${FLOTILLA_NETNS_PREFIX}h<i>, eth0 = 10.47.0.<i+1>/24, lo up;
#   bridge  = namespace ${FLOTILLA_NETNS_PREFIX}br, bridge br0, ports p<i> (veth peers of eth0);
#   RATE    = optional tc rate (e.g. 1gbit): tbf on every host's eth0 egress, so each direction
#             of every host pair is limited (burst 256kb, latency 50ms).
#
# Usage:
#   scripts/netns-hosts.sh up N [RATE]     create N hosts (replaces an existing set)
#   scripts/netns-hosts.sh down            delete them (kills what still runs inside)
#   scripts/netns-hosts.sh exec I CMD...   run CMD inside host I
#   scripts/netns-hosts.sh ip I            print host I's address
#   scripts/netns-hosts.sh status          list the hosts, addresses and qdiscs
#
# FLOTILLA_NETNS_PREFIX (default "flh") names the set, so several sets can coexist.
# Example: 2 hosts x 2 ranks over a 1 Gbit/s link
#   scripts/netns-hosts.sh up 2 1gbit
#   export FLOTILLA_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
#   scripts/netns-hosts.sh exec 0 target/release/flotilla bench comm --nnodes 2 --node-rank 0 \
#       --nproc 2 --rdzv 10.47.0.1:29500 &
#   scripts/netns-hosts.sh exec 1 target/release/flotilla bench comm --nnodes 2 --node-rank 1 \
#       --nproc 2 --rdzv 10.47.0.1:29500
#   scripts/netns-hosts.sh down
set -euo pipefail

P="${FLOTILLA_NETNS_PREFIX:-flh}"
BR="${P}br"
SUBNET="10.47.0"

die() { echo "netns-hosts: $*" >&2; exit 1; }

check() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  command -v ip >/dev/null || die "needs iproute2 (ip)"
}

hosts() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${P}h[0-9]+$" | sort -V || true; }

down() {
  local ns
  for ns in $(hosts) "$BR"; do
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$ns" || continue
    # Only processes inside this set's namespaces.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns"
  done
}

up() {
  local n="${1:?up N [RATE]}" rate="${2:-}" i ns
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || die "N must be 1..250"
  down
  trap 'echo "netns-hosts: setup failed; cleaning up" >&2; down' ERR
  ip netns add "$BR"
  ip -n "$BR" link set lo up
  ip -n "$BR" link add br0 type bridge
  ip -n "$BR" link set br0 up
  for ((i = 0; i < n; i++)); do
    ns="${P}h$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$BR"
    ip -n "$BR" link set "p$i" master br0
    ip -n "$BR" link set "p$i" up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [ -n "$rate" ]; then
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
    fi
  done
  trap - ERR
  echo "netns-hosts: $n hosts up (${P}h0..${P}h$((n - 1)), $SUBNET.1..$SUBNET.$n)${rate:+, egress limited to $rate}"
}

status() {
  local ns
  for ns in $(hosts); do
    echo "$ns: $(ip -n "$ns" -4 -o addr show dev eth0 | awk '{print $4}')"
    ip netns exec "$ns" tc qdisc show dev eth0 | sed 's/^/  /'
  done
}

cmd="${1:-}"
shift || true
case "$cmd" in
  up) check; up "$@" ;;
  down) check; down ;;
  exec)
    check
    i="${1:?exec I CMD...}"; shift
    [ $# -ge 1 ] || die "exec I CMD..."
    exec ip netns exec "${P}h$i" "$@"
    ;;
  ip) echo "$SUBNET.$((${1:?ip I} + 1))" ;;
  status) check; status ;;
  *) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; [ -z "$cmd" ] || exit 2 ;;
esac
