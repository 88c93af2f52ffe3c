#!/usr/bin/env bash
# Mutation testing of kvserve/cache/, kvserve/scheduler.py and
# kvserve/runner/sampler.py with mutmut (pip install -e '.[mutation]'); the
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
# Prints mutmut's survivors and the score per module (killed / mutants; a
# timeout counts as killed, "no tests" as survived).
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
commit=${1:-HEAD}
shift || true
work=${MUTATION_WORKDIR:-$(mktemp -d /tmp/kvserve-mutation.XXXXXX)}
mkdir -p "$work"
if [ ! -f "$work/pyproject.toml" ]; then
  git -C "$repo" archive "$commit" | tar -x -C "$work"
fi
echo "mutation run of $(git -C "$repo" rev-parse --short "$commit") in $work"
cd "$work"
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 mutmut run --max-children 1 "$@" || true
mutmut results --all true > results.txt 2>&1 || true
python "$repo/benchmarks/mutation_scores.py" results.txt
