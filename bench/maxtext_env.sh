#!/usr/bin/env bash
# Set up the benchmark-only venv with MaxText 0.2.5 and its converter's torch dependency.
#
#   bash bench/maxtext_env.sh            # idempotent: does nothing once the stamp exists
#   bash bench/maxtext_env.sh --print    # print the venv's python path (after setting up)
#
# The venv lives in bench/.maxtext-venv/ (git-ignored). It is never a ckptconv dependency.
# MaxText needs Python >= 3.12; its converter imports torch, which for 3.12 on PyPI is the
# CUDA build (~4.5 GB with its nvidia-* wheels). torch is pinned to satisfy this machine's
# pip constraint (torch<=2.14.1); matplotlib, for the RSS plot, comes with maxtext[tpu].
# The two cannot be resolved together: maxtext[tpu] 0.2.5 pins mpmath>=1.4.1 while torch 2.14.1
# needs sympy>=1.13.3, and every such sympy caps mpmath<1.4. So torch goes in second; pip then
# moves mpmath back to 1.3 and warns. The converter never touches mpmath.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.maxtext-venv"
MAXTEXT_SPEC="maxtext[tpu]==0.2.5"
TORCH_SPEC="torch==2.14.1"
STAMP="$VENV/.installed-$(printf '%s %s' "$MAXTEXT_SPEC" "$TORCH_SPEC" | cksum | cut -d' ' -f1)"

find_python312() {
  local c
  for c in "${MAXTEXT_PYTHON:-}" "$(command -v python3.12 || true)" \
           "$(command -v python3.13 || true)" \
           /root/.pyenv/versions/3.12*/bin/python3.12 \
           "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}

if [ ! -e "$STAMP" ]; then
  PY312="$(find_python312)" || {
    echo "maxtext_env: need Python >= 3.12 (set MAXTEXT_PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "maxtext_env: creating $VENV with $PY312 ($MAXTEXT_SPEC, $TORCH_SPEC); this downloads ~6 GB" >&2
  test -x "$VENV/bin/python" || "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$MAXTEXT_SPEC" 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" -c 'import maxtext, torch, matplotlib' \
    || { echo "maxtext_env: install failed (see the pip output above)" >&2; exit 1; }
  rm -f "$VENV"/.installed-* && touch "$STAMP"
fi

if [ "${1:-}" = "--print" ]; then
  echo "$VENV/bin/python"
fi
