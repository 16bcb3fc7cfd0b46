#!/usr/bin/env bash
# One device call for the Gluon experiment (throwaway, deleted with the A/B scripts): smoke tests first under
# short timeouts (a wrong barrier phase hangs rather than fails), then the full GPU tests, then the A/Bs.
# Run from the checkout root after the device prelude. Prints a short summary last. An optional first argument
# (a bash regex) picks the runs by name, e.g. `bash scratch/gluon_device.sh dkdv` (smoke_dkdv, tests_dkdv, ab_dkdv):
# all of them together can pass the 10-minute limit of one device call.
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
only=${1:-'^(smoke_fwd|smoke_dq|smoke_dkdv|tests|ab_fwd|ab_dq|ab_dkdv)$'}
hung=""  # kernels whose smoke test timed out (rc 124: a hang); their tests and A/B are skipped, not waited for
run() {
  local name=$1 limit=$2 h rc; shift 2
  [[ $name =~ $only ]] || return 0
  for h in $hung; do
    if [[ $name == *"_$h" || $name == tests ]]; then echo "$name skipped (smoke_$h hung)" >> "$out/summary.txt"; return 0; fi
  done
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1; rc=$?
  echo "$name rc=$rc" >> "$out/summary.txt"
  if [[ $name == smoke_* && $rc == 124 ]]; then hung="$hung ${name#smoke_}"; fi
}
: > "$out/summary.txt"
run smoke_fwd 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_tree_attention_gluon_gpu.py -k "forward_single_block"
run smoke_dq 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_tree_attention_gluon_gpu.py -k "dq_single_block"
run smoke_dkdv 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_tree_attention_gluon_gpu.py -k "dkdv_single_block"
run tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_tree_attention_gluon_gpu.py
run tests_dkdv 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_tree_attention_gluon_gpu.py -k dkdv
run ab_fwd 150 python3 scratch/gluon_fwd_ab.py -v
run ab_dq 150 python3 scratch/gluon_dq_ab.py -v
run ab_dkdv 150 python3 scratch/gluon_dkdv_ab.py -v
for f in smoke_fwd smoke_dq smoke_dkdv tests tests_dkdv; do [[ -f $out/$f.txt ]] && { echo "== $f"; tail -4 "$out/$f.txt"; }; done
for f in ab_fwd ab_dq ab_dkdv; do [[ -f $out/$f.txt ]] && { echo "== $f"; grep -v Warning "$out/$f.txt" | tail -12; }; done
cat "$out/summary.txt"
