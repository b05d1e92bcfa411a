#!/usr/bin/env bash
# Instructions per pipelined call (or fire-and-forget cast, or gather) at
# the controller and at the proc, counted by callgrind, which repeats where
# time does not: a shared 2-core machine moves `regent bench mesh`'s rates
# by 10-20% from run to run, these counts by 1-3% (mostly in quinn, whose
# packing of frames into packets follows the timing). A change that
# removes a function's cost shows as that line going away.
#
#   scripts/callgrind-calls.sh [call|cast|gather] [TOP]
#   REGENT_COST_PROCS=4    the procs of one member each a gather calls
#
# Runs regent/examples/call_cost.rs under `valgrind --tool=callgrind
# --trace-children=yes` twice, with 2,000 and 12,000 operations (500 and
# 3,000 gathers); the difference of each process's totals over the
# difference of the counts is its cost per
# operation (start-up and shutdown cancel out), and the same difference
# per function gives the TOP (default 30) functions by instructions of
# their own per operation. Needs valgrind and python3; takes about two
# minutes on 2 cores (a gather over 4 procs about six). Keeps its files in target/callgrind-calls/.
set -euo pipefail
mode=${1:-call}
top=${2:-30}
procs=1 small=2000 big=12000
# A gather is one round trip at a time, under callgrind dearer in time.
[[ $mode == gather ]] && procs=${REGENT_COST_PROCS:-4} small=500 big=3000
case "$mode" in call | cast | gather) ;; *)
  echo "usage: $0 [call|cast|gather] [TOP]" >&2
  exit 2
  ;;
esac
command -v valgrind >/dev/null || { echo "needs valgrind (apt install valgrind)" >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out="$root/target/callgrind-calls/$mode"
rm -rf "$out"
mkdir -p "$out"
cargo build -q --release -p regent --example call_cost
for n in $small $big; do
  REGENT_COST_MODE=$mode REGENT_COST_OPS=$n REGENT_COST_PROCS=$procs valgrind -q --tool=callgrind --trace-children=yes \
    --callgrind-out-file="$out/cg.$n.%p" target/release/examples/call_cost 2>"$out/valgrind.$n.log"
done
for f in "$out"/cg.*; do
  callgrind_annotate --auto=no --threshold=100 "$f" >"$f.txt" 2>/dev/null
done
python3 - "$out" "$top" "$mode" "$procs" "$small" "$big" <<'PY'
import glob, os, re, sys
out, top, mode, procs = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
small_n, big_n = sys.argv[5], sys.argv[6]
def runs(n):
    # The controller starts first: the lowest pid.
    fs = sorted(glob.glob(f"{out}/cg.{n}.*[0-9]"), key=lambda f: int(f.rsplit(".", 1)[1]))
    if len(fs) != 1 + procs:
        sys.exit(f"expected the controller's and {procs} procs' profiles for {n} operations, found {len(fs)}")
    return fs
def functions(path):
    total, per = 0, {}
    for line in open(path + ".txt"):
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$", line)
        if not m:
            continue
        count, name = int(m.group(1).replace(",", "")), m.group(2)
        if "PROGRAM TOTALS" in name:
            total = count
            continue
        name = re.sub(r"\s*\[[^\]]*\]$", "", name)
        name = name.split(":", 1)[1] if ":" in name and not name.startswith("<") else name
        per[name] = per.get(name, 0) + count
    return total, per
def merged(paths):
    # The mean of several processes' profiles.
    total, per = 0, {}
    for path in paths:
        t, f = functions(path)
        total += t / len(paths)
        for k, v in f.items():
            per[k] = per.get(k, 0) + v / len(paths)
    return total, per
ops = int(big_n) - int(small_n)
small, big = runs(small_n), runs(big_n)
who = "proc" if procs == 1 else f"proc (mean of {procs})"
for who, small, big in (("controller", small[:1], big[:1]), (who, small[1:], big[1:])):
    (t0, f0), (t1, f1) = merged(small), merged(big)
    print(f"{who}: {(t1 - t0) / ops:,.0f} instructions per {mode}")
    diff = sorted(((f1.get(k, 0) - f0.get(k, 0)) / ops, k) for k in set(f0) | set(f1))
    for cost, name in reversed(diff[-top:]):
        print(f"  {cost:8,.0f}  {name[:140]}")
PY
