#!/usr/bin/env bash
# Run one benchmark on two revisions of yaie, taking turns, in one run: a refactor's "no
# slowdown" claim needs both sides measured under the same load, and these machines are noisy.
#
#   benchmarks/compare_revisions.sh BASE_REV ROUNDS -- python benchmarks/sampler.py --threads 1
#
# BASE_REV is checked out into a temporary git worktree; the working tree is the other side.
# Each round runs the command once in each tree (base first, then ours), with PYTHONPATH set
# to that tree so it imports its own yaie, and its own copy of the benchmark script (a script
# whose calling convention the change altered still measures each side as it is). Every
# output is kept under benchmarks/results/revisions/ as base-N.txt / head-N.txt; compare
# the tables (or the JSON a script writes, named by its own --out) side by side. A script run in
# the working tree writes its default --out there too: a tracked result (a source of
# docs/performance.md) that the runs rewrote is restored at the end, with a line saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 4 ] || [ "$3" != "--" ]; then
    echo "usage: $0 BASE_REV ROUNDS -- COMMAND..." >&2
    exit 2
fi
base_rev=$1 rounds=$2
shift 3

out=benchmarks/results/revisions
mkdir -p "$out"
base_tree=$(mktemp -d /tmp/yaie-base-XXXXXX)
trap 'git worktree remove --force "$base_tree" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$base_tree" "$base_rev" >/dev/null
here=$(pwd)
dirty_before=$(git diff --name-only -- benchmarks/results)
echo "base: $(git -C "$base_tree" log --oneline -1)"
echo "head: $(git log --oneline -1) + working tree"

for round in $(seq 1 "$rounds"); do
    for side in base head; do
        tree=$here
        [ "$side" = base ] && tree=$base_tree
        echo "== round $round, $side"
        # Each tree builds its native kernels into a cache of its own (their sources differ).
        (cd "$tree" && PYTHONPATH="$tree" TORCH_EXTENSIONS_DIR="/tmp/yaie-ext-$side" "$@") \
            | tee "$here/$out/$side-$round.txt"
    done
done

for file in $(git diff --name-only -- benchmarks/results); do
    if ! grep -qxF "$file" <<<"$dirty_before"; then
        git checkout -- "$file"
        echo "restored $file, which the runs rewrote (give the command its own --out to keep one)"
    fi
done
