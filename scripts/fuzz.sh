#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of every decoder of outside bytes: the
# cargo-fuzz targets in fuzz/fuzz_targets/ (see ARCHITECTURE.md, "fuzz/").
# CI runs it after the tests (.ci/run, step "fuzz").
#
# Usage: scripts/fuzz.sh [TARGET...]     (default: every target)
#   FUZZ_SECONDS=60        how long each target runs
#   FUZZ_SANITIZER=none    none | address (see below)
#
# 1. Installs cargo-fuzz when it is missing (from crates.io).
# 2. Builds every target once. cargo-fuzz passes -Z flags, which stable
#    rustc refuses unless RUSTC_BOOTSTRAP=1; only the fuzz workspace
#    (fuzz/, its own target dir) is built that way.
# 3. Runs each target for FUZZ_SECONDS from its committed seeds
#    (fuzz/seeds/TARGET/, real encoded messages and `regress-*` inputs of
#    crashes found before) and the corpus it grew in earlier runs
#    (fuzz/corpus/TARGET/, not committed), then fails if any target found a
#    crash, a timeout or an out-of-memory, naming the input that reproduces
#    it (under fuzz/artifacts/TARGET/).
#
# The targets are built with overflow checks and debug assertions and,
# by default, without a sanitizer: the decoders are safe Rust, so
# AddressSanitizer finds nothing more there and costs about 2.5x the
# executions per second; overflow checks catch unchecked arithmetic on
# decoded values (with FUZZ_SANITIZER=address for code with `unsafe`).
#
# Seeds: `cargo run --manifest-path fuzz/Cargo.toml --example seeds`
# rewrites them from fuzz/examples/seeds.rs (keeping `regress-*` files);
# this script does so first and fails if that changed the committed ones.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}
sanitizer=${FUZZ_SANITIZER:-none}
# The cargo-fuzz release this script is written against.
cargo_fuzz_version=0.13.2
export RUSTC_BOOTSTRAP=1
build_flags=(--sanitizer "$sanitizer" --debug-assertions)

now() { date +%s; }
t0=$(now)

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "installing cargo-fuzz $cargo_fuzz_version"
  cargo install cargo-fuzz --version "$cargo_fuzz_version" --locked --quiet
fi
t_install=$(( $(now) - t0 ))

if (( $# )); then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi
if (( ${#targets[@]} == 0 )); then
  echo "no fuzz targets found in fuzz/" >&2
  exit 1
fi
for t in "${targets[@]}"; do
  if ! compgen -G "fuzz/seeds/$t/*" >/dev/null; then
    echo "fuzz target $t has no seeds in fuzz/seeds/$t/" \
      "(cargo run --manifest-path fuzz/Cargo.toml --example seeds)" >&2
    exit 1
  fi
done

# The seeds come from the real encoders (fuzz/examples/seeds.rs): rewrite
# them, which also checks that the generator still builds and that every
# seed decodes, and fail when the committed ones are stale (a wire format
# changed without them).
ts=$(now)
cargo run --quiet --manifest-path fuzz/Cargo.toml --example seeds
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  if ! git diff --quiet -- fuzz/seeds ||
    [[ -n $(git ls-files --others --exclude-standard -- fuzz/seeds) ]]; then
    git status --short -- fuzz/seeds >&2
    echo "fuzz: the committed seeds are stale; commit the rewritten fuzz/seeds/" >&2
    exit 1
  fi
fi
t_seeds=$(( $(now) - ts ))

t1=$(now)
echo "building ${#targets[@]} fuzz targets (sanitizer: $sanitizer)"
cargo fuzz build "${build_flags[@]}"
t_build=$(( $(now) - t1 ))

mkdir -p fuzz/logs
failed=()
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  # Only this run's findings are reported.
  rm -rf "fuzz/artifacts/$t"
  log=fuzz/logs/$t.log
  start=$(now)
  status=0
  cargo fuzz run "${build_flags[@]}" "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$seconds" -timeout=10 -print_final_stats=1 >"$log" 2>&1 || status=$?
  took=$(( $(now) - start ))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  found=()
  if [[ -d fuzz/artifacts/$t ]]; then
    mapfile -t found < <(find "fuzz/artifacts/$t" -type f | sort)
  fi
  if (( status == 0 && ${#found[@]} == 0 )); then
    printf '%-20s ok: %s runs in %ss\n' "$t" "${runs:-?}" "$took"
    continue
  fi
  failed+=("$t")
  printf '%-20s FAILED (exit %s) after %ss; log: %s\n' "$t" "$status" "$took" "$log"
  if grep -qE 'panicked at|ERROR: libFuzzer' "$log"; then
    # The panic (its message) and what libFuzzer saw.
    grep -E -A2 'panicked at' "$log" | head -n 6 | sed 's/^/    /' || true
    grep -E 'ERROR: libFuzzer|SUMMARY: libFuzzer' "$log" | sed 's/^/    /' || true
  else
    tail -n 30 "$log" | sed 's/^/    /'
  fi
  for f in "${found[@]}"; do
    echo "  reproducing input: $f"
    echo "    replay: RUSTC_BOOTSTRAP=1 cargo fuzz run ${build_flags[*]} $t $f"
    echo "    once fixed, keep it as a regression seed: cp $f fuzz/seeds/$t/regress-<what-it-broke>"
  done
done

echo "fuzz: install ${t_install}s, seeds ${t_seeds}s, build ${t_build}s, total $(( $(now) - t0 ))s"
if (( ${#failed[@]} )); then
  echo "fuzz: ${#failed[@]} of ${#targets[@]} targets failed: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets ran ${seconds}s each, no crash"
