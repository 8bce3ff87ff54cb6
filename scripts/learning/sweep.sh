#!/usr/bin/env bash
# The learning sweep of docs/training.md ("Multi-turn learning"): each env of envs/learning (and envs/lights.rhai) under the
# shipped Bandit settings (scripts/bandit.rhai, only the env and the turn count changed), one run
# at a time, then a table of validation success per run.
#   bash scripts/learning/sweep.sh [seeds...] [-- extra --set flags]
# e.g. bash scripts/learning/sweep.sh 1 2 3 -- --set starpo.filter=none
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  seeds+=("$1"); shift
done
[ ${#seeds[@]} -gt 0 ] || seeds=(1 2 3)
bin=${RAGEN_LAB:-target/release/ragen-lab}
out=${SWEEP_DIR:-runs/sweep}
mkdir -p "$out"
for env in ${SWEEP_ENVS:-lights recall elevator triage}; do
  script=scripts/learning/$env.rhai
  [ $env = lights ] && script=scripts/lights.rhai
  for seed in "${seeds[@]}"; do
    dir=$out/$env-$seed
    [ -f "$dir/summary.json" ] && continue
    rm -rf "$dir"
    start=$(date +%s)
    "$bin" train --env "$script" --set train.seed="$seed" --set rollout.seed_base=$((10000 * seed)) --run-dir "$dir" "${extra[@]}" >"$dir.log" 2>&1 || echo "$env seed $seed failed: $dir.log"
    echo "$env seed $seed: $(( $(date +%s) - start )) s"
  done
done
python3 - "$out" <<'PY'
import glob, json, os, sys
print(f"{'run':<16} {'validation success by step':<48} {'minutes':>7}")
for d in sorted(glob.glob(sys.argv[1] + "/*/")):
    ev = [json.loads(l) for l in open(d + "events.jsonl")]
    vals = [(e["step"], round(e["val/success"], 2)) for e in ev if e["kind"] == "validation"]
    mins = (ev[-1]["time"] - ev[0]["time"]) / 60 if ev else 0
    stop = [e["stop"] for e in ev if e["kind"] == "early_stop"]
    print(f"{os.path.basename(d.rstrip('/')):<16} {' '.join(f'{s}:{v}' for s, v in vals):<48} {mins:7.1f} {' '.join(stop)}")
PY
