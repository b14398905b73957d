#!/usr/bin/env bash
# Every table of docs/results/participation.md and docs/results/fairness.md that compares with the papers, in
# one command (seeds 0,1,2,3,4 by default; each table's measured run time is printed with it in
# the docs: together about 1 h 45 min on a 2-core machine shared with other jobs, plus the
# sweep with --tune). Extra arguments go to experiments/fairness_papers.py:
#
#   experiments/run_fairness_papers.sh                      # 5 seeds, the tuned values in experiments/tuning/
#   experiments/run_fairness_papers.sh --seeds 0,1,2        # 3 seeds (faster)
#   experiments/run_fairness_papers.sh --tune               # redo the validation sweeps first (long)
#   experiments/run_fairness_papers.sh --long               # add FedAU without cutoff and average-all
#   experiments/run_fairness_papers.sh --save               # write bench/results/compare_*
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" experiments/fairness_papers.py all "$@"
