#!/usr/bin/env bash
# One device call for the Gluon experiment (throwaway, deleted with the A/B scripts): smoke tests first under
# short timeouts (a wrong barrier phase hangs rather than fails), then the A/Bs (what decides), then the full
# GPU tests, stopping before BUDGET_S seconds. Run from the checkout root after the device prelude; prints a short
# summary last. An optional first argument (a bash regex) picks the runs by name, e.g.
# `bash scratch/gluon_device.sh 'tests_'` for a second call that runs only the tests.
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
only=${1:-'^(smoke_fwd|smoke_dq|smoke_dkdv|ab_fwd|ab_dq|ab_dkdv|tests_fwd|tests_dq|tests_dkdv)$'}
budget=${BUDGET_S:-540}  # no run starts after this many seconds (one device call is limited to 600)
begin=$SECONDS
hung=""  # kernels whose smoke test timed out (rc 124: a hang); their tests and A/B are skipped, not waited for
run() {
  local name=$1 limit=$2 h rc left; shift 2
  [[ $name =~ $only ]] || return 0
  for h in $hung; do
    if [[ $name == *"_$h" ]]; then echo "$name skipped (smoke_$h hung)" >> "$out/summary.txt"; return 0; fi
  done
  left=$((budget - (SECONDS - begin)))
  if (( left < 30 )); then echo "$name not started (time budget spent)" >> "$out/summary.txt"; return 0; fi
  (( limit > left )) && limit=$left
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1; rc=$?
  echo "$name rc=$rc ($((SECONDS - begin)) s)" >> "$out/summary.txt"
  if [[ $name == smoke_* && $rc == 124 ]]; then hung="$hung ${name#smoke_}"; fi
}
: > "$out/summary.txt"
T=tests/test_tree_attention_gluon_gpu.py
P="python3 -m pytest -q -p no:cacheprovider"
# smoke tests, then the A/Bs (speed and error vs fp32 of each kernel: what decides), then the full tests
run smoke_fwd 120 $P -x $T -k "forward_single_block"
run smoke_dq 120 $P -x $T -k "dq_single_block"
run smoke_dkdv 120 $P -x $T -k "dkdv_single_block"
run ab_fwd 150 python3 scratch/gluon_fwd_ab.py -v
run ab_dq 150 python3 scratch/gluon_dq_ab.py -v
run ab_dkdv 150 python3 scratch/gluon_dkdv_ab.py -v
run tests_fwd 300 $P $T -k "forward"
run tests_dq 300 $P $T -k "dq"
run tests_dkdv 300 $P $T -k "dkdv"
for f in smoke_fwd smoke_dq smoke_dkdv tests_fwd tests_dq tests_dkdv; do [[ -f $out/$f.txt ]] && { echo "== $f"; tail -4 "$out/$f.txt"; }; done
for f in ab_fwd ab_dq ab_dkdv; do [[ -f $out/$f.txt ]] && { echo "== $f"; grep -v Warning "$out/$f.txt" | tail -12; }; done
cat "$out/summary.txt"
