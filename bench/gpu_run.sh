#!/usr/bin/env bash
# The one command of the GPU run (bench/README.md): on a CUDA machine with torch and triton already
# installed and no package index. Installs the wheels of .whl/ (bench/gpu_wheels.txt, fetched beforehand
# by `make gpu-wheels`) into a folder of its own, then runs bench/gpu_bench.py with a deadline.
#
#   bash bench/gpu_run.sh OUT_JSON [DEADLINE_SECONDS] [gpu_bench.py options ...]
#
# OUT_JSON: where the results go (on the lent machine, under $OUT); DEADLINE_SECONDS (default 420): no
# unit starts that would end past it, so one command of at most 7 minutes holds the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/gpu_run.sh OUT_JSON [DEADLINE_SECONDS] [options]}
deadline=${2:-420}
shift $(( $# >= 2 ? 2 : 1 ))
if compgen -G ".whl/*.whl" > /dev/null; then
  site=${SONAR_SITE:-/tmp/sonar-site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec python3 bench/gpu_bench.py --out "$out" --deadline "$deadline" "$@"
