#!/usr/bin/env bash
# The chaos crate's recipe for link faults with root (chaos/src/netns.rs runs
# it), adapted from shared/infra/netns-setup.sh, known to work on this
# machine kind: PFX names a run's namespaces so runs at once do not collide,
# and `down` succeeds when nothing is there.
#
# N fake "hosts" (netns h1..hN) on one L2 switch (bridge br0 inside netns hbr).
# hK: eth0 = 10.77.0.K/24. Optional ROOT_LEG=1: root ns gets "h0root" 10.77.0.254/24
# so an un-namespaced test harness can reach every host.
# Requires root (CAP_NET_ADMIN + CAP_SYS_ADMIN). Kernel needs VETH, BRIDGE, NET_NS.
#
#   netns-setup.sh up [N]          create h1..hN (default 3)
#   netns-setup.sh down            delete everything
#   netns-setup.sh cut K | heal K  switch port of hK down/up (carrier loss)
#   netns-setup.sh nft-drop K | nft-undrop K        hK firewall drops all eth0 traffic (nftables)
#   netns-setup.sh ipt-drop K | ipt-undrop K        same with iptables
#   netns-setup.sh block A B | unblock A B          one-way drop A->B at the switch (nft bridge family)
#   netns-setup.sh loss K PCT | unloss K            random loss PCT% on hK egress (nft numgen; netem absent)
#   netns-setup.sh rate K RATE | unrate K           tbf rate limit on hK eth0, e.g. RATE=1mbit
#   netns-setup.sh rx K            packets hK's eth0 has received (its kernel counter)
#   netns-setup.sh root-tx         packets the root ns has sent on its leg (ROOT_LEG=1)
#   netns-setup.sh dropped K       packets hK's firewall (nft-drop) has dropped so far
#   netns-setup.sh blocked A B     packets the A->B block has dropped so far
# (The counters show that a fault had an effect: the chaos runner reads them.)
set -euo pipefail
PFX=${PFX:-h}; BR=${PFX}br; NET=10.77.0
cmd=${1:-up}; shift || true

up() {
  local n=${1:-3}
  ip netns add $BR
  ip -n $BR link set lo up
  ip -n $BR link add br0 type bridge
  ip -n $BR link set br0 up
  for k in $(seq 1 $n); do
    ip netns add $PFX$k
    ip -n $PFX$k link set lo up
    # create pair inside the bridge ns, then move one end into hK and rename it eth0
    ip -n $BR link add v$k type veth peer name tmp$k
    ip -n $BR link set tmp$k netns $PFX$k
    ip -n $PFX$k link set tmp$k name eth0
    ip -n $PFX$k addr add $NET.$k/24 dev eth0
    ip -n $PFX$k link set eth0 up
    ip -n $BR link set v$k master br0
    ip -n $BR link set v$k up
  done
  if [[ ${ROOT_LEG:-0} == 1 ]]; then
    ip link add ${PFX}0root type veth peer name v0 netns $BR
    ip addr add $NET.254/24 dev ${PFX}0root
    ip link set ${PFX}0root up
    ip -n $BR link set v0 master br0
    ip -n $BR link set v0 up
  fi
}

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^${PFX}([0-9]+|br)$"); do
    ip netns pids $ns | xargs -r kill 2>/dev/null || true   # processes started in the ns
    ip netns del $ns
  done
  ip link del ${PFX}0root 2>/dev/null || true
  return 0
}

bridge_table() {
  ip netns exec $BR nft list table bridge part >/dev/null 2>&1 ||
    ip netns exec $BR nft 'add table bridge part; add chain bridge part pfwd { type filter hook forward priority 0; policy accept; }'
}

# Sums the "packets N" of nft counters on lines containing $1 (all if empty).
packets() {
  awk -v r="${1:-}" 'index($0, r) { for (i = 1; i < NF; i++) if ($i == "packets") s += $(i + 1) } END { print s + 0 }'
}

case $cmd in
  up)        up "$@" ;;
  down)      down ;;
  cut)       ip -n $BR link set v$1 down ;;
  heal)      ip -n $BR link set v$1 up ;;
  nft-drop)  ip netns exec $PFX$1 nft 'add table inet part; add chain inet part in { type filter hook input priority 0; policy accept; }; add chain inet part out { type filter hook output priority 0; policy accept; }; add rule inet part in iifname "eth0" counter drop; add rule inet part out oifname "eth0" counter drop' ;;
  nft-undrop) ip netns exec $PFX$1 nft delete table inet part ;;
  ipt-drop)  ip netns exec $PFX$1 iptables -A INPUT -i eth0 -j DROP
             ip netns exec $PFX$1 iptables -A OUTPUT -o eth0 -j DROP ;;
  ipt-undrop) ip netns exec $PFX$1 iptables -F ;;
  block)     bridge_table; ip netns exec $BR nft add rule bridge part pfwd iifname "v$1" oifname "v$2" counter drop ;;
  unblock)   ip netns exec $BR nft -a list chain bridge part pfwd | awk -v r="iifname \"v$1\" oifname \"v$2\"" 'index($0,r){print $NF}' |
               xargs -r -I{} ip netns exec $BR nft delete rule bridge part pfwd handle {} ;;
  loss)      ip netns exec $PFX$1 nft "add table inet loss; add chain inet loss out { type filter hook output priority 0; }; add rule inet loss out oifname \"eth0\" numgen random mod 100 < $2 drop" ;;
  unloss)    ip netns exec $PFX$1 nft delete table inet loss ;;
  rate)      ip netns exec $PFX$1 tc qdisc replace dev eth0 root tbf rate $2 burst 32kbit latency 50ms ;;
  unrate)    ip netns exec $PFX$1 tc qdisc del dev eth0 root ;;
  rx)        ip netns exec $PFX$1 cat /sys/class/net/eth0/statistics/rx_packets ;;
  root-tx)   cat /sys/class/net/${PFX}0root/statistics/tx_packets ;;
  dropped)   ip netns exec $PFX$1 nft list table inet part | packets ;;
  blocked)   ip netns exec $BR nft list chain bridge part pfwd | packets "iifname \"v$1\" oifname \"v$2\"" ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
