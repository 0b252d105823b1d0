#!/usr/bin/env bash
# Build a cached environment of another Python for pdstate's torch-free surface
# (tests/unit/test_pythons.py runs `pdstate --version`, `check`, `probe` and the torch-free
# modules in it).
#
#   tools/python_env.sh PYTHON DIR
#
# make python-envs builds .venv/py3.10 and .venv/py3.12. DIR is a venv of PYTHON holding
# pyproject's runtime dependencies except torch (from this host's pip configuration, as the main
# venv); pdstate itself is not installed: the tests put the tree's src/ on PYTHONPATH. PYTHON is a
# command or a path; a pyenv shim of a version that is not active is resolved to that version's
# interpreter. DIR/.stamp records a hash of what is installed and the interpreter's version; with
# an equal stamp this does nothing. The main venv is never touched. Exit status 3 means PYTHON is
# not on this host: the tests then skip with this script's one line.
set -euo pipefail
PY=${1:?usage: python_env.sh PYTHON DIR}
DIR=${2:?usage: python_env.sh PYTHON DIR}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
NO_PYTHON=3

runs() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }

# 1. the interpreter: as given, else a pyenv version's (the shim refuses versions not selected)
if ! runs "$PY"; then
  found=""
  if command -v pyenv >/dev/null 2>&1 && [ -d "$(pyenv root)/versions" ]; then
    found="$(ls -d "$(pyenv root)"/versions/*/bin/"$(basename "$PY")" 2>/dev/null | sort -V | tail -1 || true)"
  fi
  if [ -z "$found" ] || ! runs "$found"; then
    echo "python-env: no $PY interpreter on this host (the tests of $(basename "$PY") skip)" >&2
    exit $NO_PYTHON
  fi
  PY="$found"
fi

# 2. what to install: pyproject's dependencies less torch (tomllib, or pip's own tomli on 3.10)
reqs="$("$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
    name = dep.split(";")[0].strip()
    for sep in "<>=!~[ ":
        name = name.split(sep)[0]
    if name.lower() != "torch":
        print(dep)
PYEOF
)"
want="$(printf '%s\n%s\n' "$reqs" "$(sha256sum "$0" | cut -c1-16)" | sha256sum | cut -c1-16) $("$PY" -c 'import platform; print("py" + platform.python_version())')"
STAMP="$DIR/.stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

# 3. build beside DIR, then swap it in and stamp
start=$(date +%s)
mkdir -p "$(dirname "$DIR")"
work="$(mktemp -d "${DIR%/}.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$PY" -m venv --without-pip "$work/env"
# the interpreter's own pip installs into the new venv (pip >= 22.3): no pip copied into it
mapfile -t req_args < <(printf '%s\n' "$reqs")
if ! "$PY" -m pip --python "$work/env/bin/python" install -q --disable-pip-version-check --no-input "${req_args[@]}" 2>"$work/pip.log"; then
  cat "$work/pip.log" >&2
  exit 1
fi
rm -rf "$DIR"
mv "$work/env" "$DIR"
echo "$want" >"$STAMP"
echo "python-env: $DIR built in $(($(date +%s) - start)) s ($("$DIR/bin/python" -V), $(du -sh "$DIR" | cut -f1))"
