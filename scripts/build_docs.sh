#!/usr/bin/env bash
# Build the documentation site as CI does: bash scripts/build_docs.sh VENV [SITE_DIR]
# VENV: a virtual environment that already holds marlhf's dependencies (e.g. CI's .venv, with torch); the `docs`
# extra is installed into it. The build is strict (any warning fails it) and offline. SITE_DIR defaults to a
# temporary directory, removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:?usage: scripts/build_docs.sh VENV [SITE_DIR]}
"$venv/bin/pip" install -q $("$venv/bin/python" -c \
  "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))")
site=${2:-}
if [ -z "$site" ]; then
  site=$(mktemp -d)
  trap 'rm -rf "$site"' EXIT
fi
# NO_MKDOCS_2_WARNING: Material's end-of-life banner (not a build warning) stays out of the log.
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --site-dir "$site"
echo "docs: built into $site"
