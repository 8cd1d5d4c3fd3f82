#!/usr/bin/env bash
# The project's venv for this checkout, shared by every checkout with the same dependency
# list: `.venv` is a link to ~/.cache/omnipipe/venvs/<key>, where <key> hashes the files
# that decide what is installed (the Makefile's VENV_INPUTS). A fresh clone (CI's) with a
# known list links to the venv already built instead of installing 6 GB again; a new list
# builds a new one (hack/install-venv.sh) and the two newest are kept.
#   venv.sh KEY EXTRAS
# omnipipe is an editable install, which points at one checkout: when the venv's points
# at another, it is installed again (--no-deps, seconds). The tests' plugin family is
# not in the venv at all (tests/harness/plugin_path.py), and one an older venv still has
# is removed. A `.venv` that is a plain folder (made before the venvs were shared) is
# kept and installed into as before.
set -euo pipefail
cd "$(dirname "$0")/.."
KEY="$1"
EXTRAS="$2"
STORE="${OMNIPIPE_VENV_STORE:-$HOME/.cache/omnipipe/venvs}"
log() { printf '[venv %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# Installed into the venv before the plugin moved out of it: it would show its
# pipeline type to every user command (omnipipe crd, make serve).
drop_test_family() {
  if "$1/bin/python" -m pip show --quiet omnipipe-sketch >/dev/null 2>&1; then
    log "removing the tests' plugin family from the venv (it lives in build/test-plugins)"
    "$1/bin/python" -m pip uninstall --quiet --yes omnipipe-sketch
  fi
}

if [[ -d .venv && ! -L .venv ]]; then
  if [[ ! -f .venv/.installed-$KEY ]]; then
    bash hack/install-venv.sh .venv "$EXTRAS"
    rm -f .venv/.installed-*
    touch ".venv/.installed-$KEY"
  fi
  drop_test_family .venv
  exit 0
fi

target="$STORE/$KEY"
if [[ ! -f "$target/.installed" ]]; then
  log "building the venv for this dependency list: $target"
  mkdir -p "$STORE"
  rm -rf "$target"
  bash hack/install-venv.sh "$target" "$EXTRAS"
  touch "$target/.installed"
  # The two newest stay: this one and the one before (another branch's, say).
  ls -1dt "$STORE"/*/ | tail -n +3 | while read -r old; do
    log "removing an older venv: $old"
    rm -rf "$old"
  done
fi
ln -sfn "$target" .venv

here="$(pwd -P)"
# -I: asked from this checkout, `python -c` would find ./omnipipe on its own path and
# never the install's target (a clone at another path kept the old one).
origin=$(.venv/bin/python -I -c 'import importlib.util as u; print(u.find_spec("omnipipe").origin)' 2>/dev/null || true)
if [[ "$origin" != "$here/omnipipe/__init__.py" ]]; then
  log "pointing the venv's editable install at this checkout ($here)"
  .venv/bin/python -m pip install --quiet --progress-bar off --no-deps -e .
fi
drop_test_family .venv
