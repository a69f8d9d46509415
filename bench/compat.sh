#!/usr/bin/env bash
# The torch releases tpcompile supports, each tried in a venv of its own (outside CI).
#
#   bash bench/compat.sh [VERSION ...]     default: 2.11.0 2.12.1 2.13.0 2.14.1
#
# Per release: a venv under $COMPAT_DIR (default /tmp/tpcompile-compat; kept, so a rerun
# installs nothing), `pip install torch==VERSION -e '.[test]'` (the CUDA wheels from the
# package index run on the CPU: about 5 GB and 2 minutes each), then
#   demo      tpcompile demo (2 gloo ranks, 3 AdamW steps, errors against the unsharded model)
#   unit      pytest tests/unit -m "not slow and not compile"
#   numerics  the support table's gloo numerics: tests/gloo/test_numerics.py,
#             test_sequence_parallel.py, test_hf_models.py (2 and 4 ranks)
#   plans     bench/compat_plans.py, diffed against the first release given
# Writes a markdown table (release x check) to bench/results/compat-DATE.md and prints it;
# each check's log lies in $COMPAT_DIR/torch-VERSION/*.log. Exits 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
dir="${COMPAT_DIR:-/tmp/tpcompile-compat}"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.12.1 2.13.0 2.14.1)
mkdir -p "$dir" bench/results
out="bench/results/compat-$(date +%Y-%m-%d).md"
cores=$(nproc)  # before OMP_NUM_THREADS, which nproc reports instead
export OMP_NUM_THREADS=1
status=0
reference=""

check() {  # check NAME LOG COMMAND...: "passed" or "FAILED (see LOG)"
  local name=$1 log=$2; shift 2
  if "$@" >"$log" 2>&1; then echo "passed"; else status=1; echo "FAILED ($name: $log)"; fi
}

{
  echo "# torch releases: \`bash bench/compat.sh $*\`"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $cores CPU cores (OMP_NUM_THREADS=1), Python $(python3 -V | cut -d' ' -f2), tpcompile $(git rev-parse --short HEAD)"
  echo
  echo "| torch | install | demo | unit tests | support-table numerics (gloo) | plans equal to the first row |"
  echo "|---|---|---|---|---|---|"
} >"$out"

for v in "${versions[@]}"; do
  venv="$dir/torch-$v"
  echo "== torch $v ($venv)" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  install=$(check install "$venv/install.log" "$venv/bin/pip" install -q "torch==$v" -e "$root[test]")
  py="$venv/bin/python"
  got=$("$py" -c "import torch; print(torch.__version__)" 2>/dev/null || echo "?")
  demo=$(check demo "$venv/demo.log" "$venv/bin/tpcompile" demo)
  unit=$(check unit "$venv/unit.log" "$py" -m pytest -q tests/unit -m "not slow and not compile")
  numerics=$(check numerics "$venv/numerics.log" "$py" -m pytest -q \
    tests/gloo/test_numerics.py tests/gloo/test_sequence_parallel.py tests/gloo/test_hf_models.py)
  plans=$(check plans "$venv/plans.log" "$py" -m bench.compat_plans)
  if [ "$plans" = passed ]; then
    cp "$venv/plans.log" "$venv/plans.json"
    if [ -z "$reference" ]; then
      reference="$venv/plans.json"; plans="(reference)"
    elif diff -q "$reference" "$venv/plans.json" >/dev/null; then
      plans="equal"
    else
      status=1; plans="DIFFER (diff $reference $venv/plans.json)"
    fi
  fi
  summary() { [ "${1%% *}" = passed ] && tail -1 "$2" | sed 's/=//g; s/^ *//; s/ *$//' || echo "$1"; }
  echo "| $got | $install | $demo | $(summary "$unit" "$venv/unit.log") | $(summary "$numerics" "$venv/numerics.log") | $plans |" >>"$out"
done
cat "$out"
exit $status
