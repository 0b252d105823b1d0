#!/usr/bin/env bash
# Build a cached SGLang environment (the lock's own release, or VERSION) the tests in tests/sglang
# run the real code from.
#
#   tools/sglang_env.sh PYTHON DIR [VERSION]
#
# make sglang-env builds every release of the table (src/pdstate/integrations/sglang/releases.py),
# each in its row's env_dir: .venv/sglang-env (the lock's own sglang line, no VERSION) and
# .venv/sglang-env-<release> (VERSION replaces the lock's sglang line; the rest of the lock is shared).
#
# Every line of tools/sglang-env.txt is installed with --no-deps into DIR (pip --target), except
# those whose distribution PYTHON's environment already has: nothing is installed into that
# environment and its CPU torch is never touched. DIR/.stamp records the lock's hash and the Python
# version; with an equal stamp this does nothing. Exit status 3 means the sglang wheel cannot be
# fetched (no index, or no wheel for this Python): the tests then skip with that one line.
set -euo pipefail
PY=${1:?usage: sglang_env.sh PYTHON DIR}
DIR=${2:?usage: sglang_env.sh PYTHON DIR [VERSION]}
VERSION=${3:-}
LOCK="$(cd "$(dirname "$0")" && pwd)/sglang-env.txt"
STAMP="$DIR/.stamp"

want="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest()[:16], "py%d.%d" % sys.version_info[:2], sys.argv[2] or "lock")' "$LOCK" "$VERSION")"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

start=$(date +%s)
work="$(mktemp -d "${DIR%/}.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
pip_q=(-q --disable-pip-version-check --no-input)

# 1. the wheel itself: the one thing whose absence skips the tests
sglang_req="$(grep -m1 '^sglang==' "$LOCK")"
if [ -n "$VERSION" ]; then sglang_req="sglang==$VERSION"; fi
if ! "$PY" -m pip download "${pip_q[@]}" --no-deps "$sglang_req" -d "$work/wheels" >"$work/download.log" 2>&1; then
  echo "sglang-env: cannot fetch the $sglang_req wheel for $("$PY" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])'): $(grep -m1 -E 'ERROR|error' "$work/download.log" || tail -1 "$work/download.log")" >&2
  exit 3
fi

# 2. the rest of the lock, less what the environment already has
"$PY" - "$LOCK" >"$work/reqs.txt" <<'PYEOF'
import importlib.metadata as md
import sys

for line in open(sys.argv[1]):
    req = line.split("#", 1)[0].strip()
    if not req or req.startswith("sglang=="):
        continue
    try:
        md.version(req.split("==")[0])
    except md.PackageNotFoundError:
        print(req)
PYEOF
"$PY" -m pip install "${pip_q[@]}" --no-deps --target "$work/env" "$work"/wheels/sglang-*.whl -r "$work/reqs.txt"

# 3. swap in atomically-enough, then stamp
rm -rf "$DIR"
mv "$work/env" "$DIR"
echo "$want" >"$STAMP"
echo "sglang-env: $DIR built in $(($(date +%s) - start)) s ($(du -sh "$DIR" | cut -f1))"
