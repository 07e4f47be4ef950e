#!/usr/bin/env bash
# Installs MaxText 0.2.5 and the modules its model code imports into a folder OUTSIDE the
# project venv, for examples/maxtext_adopt.py:
#
#   bash examples/maxtext_install.sh [DIR]   # DIR: ~/.cache/jax_flashcomm/maxtext-0.2.5
#   .venv/bin/python examples/maxtext_adopt.py --quick   # (PYTHONPATH=DIR for another DIR)
#
# Everything goes in with --no-deps and a pinned version, so the venv's jax, jaxlib, flax and
# numpy (and every other package it already has) stay the ones in use: a package the venv
# already has is never installed into DIR. MaxText 0.2.5 declares Python>=3.12 and jax>=0.11;
# on Python 3.11 two PEP 695 `type X = ...` lines are rewritten into plain assignments, and
# tokamax is pinned at 0.0.12 (the last release for Python 3.11, no PEP 695 syntax; it pins
# typeguard==2.13.3). jax 0.10.2's missing jax.experimental.xla_metadata.must_fuse_call is
# stubbed by maxtext_adopt.py at import time (only the flash-attention kernel calls it; the
# example uses attention="dot_product"). Idempotent: a second run installs nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/jax_flashcomm/maxtext-0.2.5}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

# What maxtext.configs.pyconfig, maxtext.models.models, maxtext.utils.maxtext_utils,
# maxtext.utils.model_creation_utils and maxtext.utils.maxtext_utils_nnx import (found by
# importing them until nothing was missing), pinned. Those with a compiled extension are
# marked (binary wheels for cp311 are on the index); the rest are pure Python.
PINS=(
  maxtext==0.2.5
  omegaconf==2.4.0
  pydantic==2.14.4 pydantic-core==2.50.5      # pydantic-core: compiled
  annotated-types==0.8.0 typing-inspection==0.4.5
  pathwaysutils==0.1.13 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
  opentelemetry-api==1.45.2 uvicorn==0.54.0
  qwix==0.1.8 aqtp==0.9.0
  tokamax==0.0.12 immutabledict==4.3.1 jaxtyping==0.3.11 wadler-lindig==0.1.8
  typeguard==2.13.3 einshape==1.0
  transformers==5.24.0 regex==2026.11.19           # regex: compiled
  grain==0.2.18 cloudpickle==3.1.3 portpicker==1.6.0
  array-record==0.8.6                              # compiled
  drjax==0.2.1 tiktoken==0.14.0 sentencepiece==0.2.3   # tiktoken, sentencepiece: compiled
  sympy==1.14.0 mpmath==1.4.1
)
NEVER="jax jaxlib flax numpy ml-dtypes ml_dtypes"

norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
venv_version() {   # the venv's version of a distribution, or nothing (PYTHONPATH unset)
  env -u PYTHONPATH "$PY" - "$1" <<'EOF'
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass
EOF
}
dir_version() {    # the version of a distribution installed in DIR, or nothing
  local want d name
  want=$(norm "$1")
  for d in "$DIR"/*.dist-info; do
    [ -e "$d" ] || continue
    name=$(sed -n 's/^Name: //p' "$d/METADATA" | head -1)
    if [ "$(norm "$name")" = "$want" ]; then sed -n 's/^Version: //p' "$d/METADATA" | head -1; return; fi
  done
}

echo "maxtext_install: python $PY ($(env -u PYTHONPATH "$PY" -c 'import sys; print(sys.version.split()[0])')), target $DIR"
installed=0
for pin in "${PINS[@]}"; do
  pkg=${pin%%==*}; ver=${pin##*==}
  for bad in $NEVER; do
    [ "$(norm "$pkg")" = "$(norm "$bad")" ] && { echo "refusing to install $pkg" >&2; exit 1; }
  done
  have=$(venv_version "$pkg")
  if [ -n "$have" ]; then echo "  skip $pkg: the venv has $have"; continue; fi
  got=$(dir_version "$pkg")
  if [ "$got" = "$ver" ]; then echo "  ok   $pkg==$ver (already in target)"; continue; fi
  [ -n "$got" ] && echo "  $pkg $got in target, replacing with $ver"
  echo "  pip  $pkg==$ver"
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --ignore-requires-python \
    --upgrade --target "$DIR" "$pkg==$ver" 2>&1 | grep -v "^WARNING: Location" || true
  [ "$(dir_version "$pkg")" = "$ver" ] || { echo "failed to install $pkg==$ver" >&2; exit 1; }
  installed=$((installed + 1))
done
echo "maxtext_install: $installed installed"

# Python 3.11 cannot parse PEP 695 type statements: `type X = Y` -> `X = Y` (idempotent).
for f in maxtext/kernels/mhc/common.py maxtext/kernels/mhc/api.py; do
  path=$DIR/$f
  if grep -qE '^type [A-Za-z_][A-Za-z0-9_]* = ' "$path"; then
    grep -nE '^type [A-Za-z_][A-Za-z0-9_]* = ' "$path" | sed "s|^|  rewrite $f:|"
    sed -i -E 's/^type ([A-Za-z_][A-Za-z0-9_]*) = /\1 = /' "$path"
  else
    echo "  ok   $f: no PEP 695 type statement"
  fi
done

# Nothing in DIR may shadow the venv's packages (PYTHONPATH comes before site-packages).
clash=""
for top in "$DIR"/*; do
  name=$(basename "$top")
  case $name in *.dist-info|bin|__pycache__) continue ;; esac
  name=${name%.py}; name=${name%%.cpython-*}
  if env -u PYTHONPATH "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$name') is None)" 2>/dev/null; then
    clash="$clash $name"
  fi
done
[ -z "$clash" ] || { echo "maxtext_install: $DIR shadows venv modules:$clash" >&2; exit 1; }

# The check that counts: MaxText's model path imports, with the venv's jax and flax.
PYTHONPATH=$DIR "$PY" - <<'EOF'
import jax.experimental.xla_metadata as xm
if not hasattr(xm, "must_fuse_call"):      # jax 0.10.2 lacks it; maxtext_adopt.py stubs it too
    xm.must_fuse_call = lambda *a, **k: (lambda f: f)
import jax, flax, numpy
import maxtext.configs.pyconfig, maxtext.models.models, maxtext.utils.maxtext_utils  # noqa
import maxtext.utils.model_creation_utils, maxtext.utils.maxtext_utils_nnx  # noqa
import maxtext, os
for mod in (jax, flax, numpy):
    assert "site-packages" in mod.__file__, mod.__file__
print(f"maxtext_install: imports OK: maxtext at {os.path.dirname(maxtext.__file__)}, "
      f"jax {jax.__version__}, flax {flax.__version__}, numpy {numpy.__version__} (the venv's)")
EOF
