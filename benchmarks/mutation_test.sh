#!/usr/bin/env bash
# Mutation testing of kvserve/cache/, kvserve/scheduler.py, kvserve/sampling_params.py,
# kvserve/request.py, kvserve/detokenizer.py, kvserve/outputs.py
# and kvserve/runner/ (batch.py, staging.py, sampler.py) with mutmut
# (pip install -e '.[mutation]'); the
# configuration (modules, the fast CPU tests it runs) is [tool.mutmut] in
# pyproject.toml. Not part of CI: it takes tens of minutes on 2 cores.
#
# It runs on a clean `git archive` of a commit (default HEAD) in a scratch
# directory, so uncommitted edits in the working tree neither leak into the
# run nor get a `mutants/` directory dropped next to them. One worker, at
# nice priority: the machine is shared.
#
#   benchmarks/mutation_test.sh [COMMIT] [MUTANT_GLOB...]
#   benchmarks/mutation_test.sh HEAD 'kvserve.cache.*'          # one package
#   MUTATION_WORKDIR=/tmp/mut benchmarks/mutation_test.sh HEAD  # reuse a run (mutmut resumes)
#
# Sampling (a package too large to run in full): MUTATION_SAMPLE=N runs a
# uniform random sample of N of the mutants matching the globs (all when none
# is given), drawn with MUTATION_SEED (default 0) by mutation_sample.py from
# the sorted mutant names, so a commit and a seed always give the same sample.
# The scores then count only the sample, with a 95 % interval.
#
#   MUTATION_SAMPLE=250 MUTATION_SEED=1 benchmarks/mutation_test.sh HEAD 'kvserve.cache.*'
#
# MUTATION_TESTS="tests/a.py tests/b.py" replaces the test selection in the
# scratch copy: mutmut only runs, per mutant, the selected tests that reach the
# mutated function, so naming every file that reaches a module's code scores
# that module exactly as the full selection does, without the full selection's
# stats run (the cache walks: minutes). The scheduler's code is reached only by
#   tests/test_scheduler_unit.py tests/test_scheduling_policy.py
#   tests/test_kv_cache_reference.py tests/test_kv_pressure_policy.py tests/test_cache_manager.py
#
# Prints mutmut's survivors and the score per module (killed / mutants; a
# timeout counts as killed, "no tests" as survived).
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
here="$repo/benchmarks"
commit=${1:-HEAD}
shift || true
work=${MUTATION_WORKDIR:-$(mktemp -d /tmp/kvserve-mutation.XXXXXX)}
mkdir -p "$work"
if [ ! -f "$work/pyproject.toml" ]; then
  git -C "$repo" archive "$commit" | tar -x -C "$work"
fi
echo "mutation run of $(git -C "$repo" rev-parse --short "$commit") in $work"
cd "$work"
if [ -n "${MUTATION_TESTS:-}" ]; then
  python "$here/mutation_select.py" pyproject.toml $MUTATION_TESTS
fi
mutmut_run() {
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 mutmut run --max-children 1 "$@" || true
}
sample=""
if [ -n "${MUTATION_SAMPLE:-}" ]; then
  # Generate every mutant (and the per-test stats) without running any: a
  # name that matches nothing stops mutmut right after that.
  if [ ! -f mutants/mutmut-stats.json ]; then
    mutmut_run 'kvserve.no_such_module.x_none__mutmut_0' > generate.log 2>&1
  fi
  mutmut results --all true > all_mutants.txt 2>&1
  python "$here/mutation_sample.py" all_mutants.txt "$MUTATION_SAMPLE" "${MUTATION_SEED:-0}" "$@" > sample.txt
  sample=sample.txt
  mapfile -t names < sample.txt
  mutmut_run "${names[@]}"
else
  mutmut_run "$@"
fi
mutmut results --all true > results.txt 2>&1 || true
python "$here/mutation_scores.py" results.txt $sample
