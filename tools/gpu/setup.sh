# Device setup, to be *sourced* (not run) from the repository root copy on the GPU machine, after the
# build-parts calls have installed the parts (../shared/gpu/README.md):   source tools/gpu/setup.sh
# It sources the parts' env.sh, installs the extra wheels in .wheels-gpu/ when that folder exists,
# installs the project's four packages (editable, no network) from .snap/packages/ when a snapshot was
# copied there, else from packages/, sets GGUF, prints the vLLM version and the snapshot's commit, and
# leaves the shell in .snap/ when there is one (scripts there refer to ../tools/gpu). Safe under
# `set -u`; never exits the calling shell. Each pip step logs to $OUT/setup.log and prints a
# "SETUP FAILED" line if it fails; KVARN_SETUP_OK is 1 only if all went well.
# KVARN_GPU_PARTS names the parts' folder (default /tmp/kvarn-gpu); KVARN_GPU_FILES (set by env.sh) the
# model files' folder. Tested by tools/tests/test_gpu_tools.py.

KVARN_SETUP_OK=1
_ks_parts="${KVARN_GPU_PARTS:-/tmp/kvarn-gpu}"
_ks_log="${OUT:-/tmp}/setup.log"
mkdir -p "$(dirname "$_ks_log")" 2>/dev/null
echo "== setup.sh $(date -u +%FT%TZ) in $(pwd)" >>"$_ks_log" 2>/dev/null || _ks_log=/dev/null

_ks_fail() {
  KVARN_SETUP_OK=0
  echo "SETUP FAILED: $1 (log: $_ks_log)"
  [ "$_ks_log" != /dev/null ] && tail -n 15 "$_ks_log" | sed 's/^/  | /'
  return 0
}

_ks_step() {  # _ks_step "what" cmd args...: run, log to $_ks_log, report failure clearly
  local what=$1
  shift
  echo "-- $what: $*" >>"$_ks_log"
  if "$@" >>"$_ks_log" 2>&1; then
    echo "setup: $what ok"
  else
    _ks_fail "$what (exit $?)"
  fi
}

# (a) what build-parts installed
if [ -f "$_ks_parts/env.sh" ]; then
  # shellcheck disable=SC1091
  source "$_ks_parts/env.sh"
else
  _ks_fail "$_ks_parts/env.sh is missing: make the build-parts calls first (the machine went cold?)"
fi

# (b) extra wheels vLLM 0.26.0 needed that the image and the base part lacked (older runs carried them)
if [ -d .wheels-gpu ]; then
  if compgen -G ".wheels-gpu/*.whl" >/dev/null; then
    _ks_step "pip install .wheels-gpu" python3 -m pip install -q --no-deps --no-index .wheels-gpu/*.whl
  else
    _ks_fail "no wheels in .wheels-gpu/"
  fi
fi

# (c) the project's packages (hatchling and editables come with the base part)
_ks_pkgs=packages
[ -d .snap/packages ] && _ks_pkgs=.snap/packages
if [ -d "$_ks_pkgs/kvarn-math" ]; then
  _ks_step "pip install -e kvarn packages from $_ks_pkgs" python3 -m pip install -q --no-deps \
    --no-build-isolation -e "$_ks_pkgs/kvarn-math" -e "$_ks_pkgs/kvarn-kernels" \
    -e "$_ks_pkgs/kvarn-vllm" -e "$_ks_pkgs/kvarn-eval"
else
  _ks_fail "run from the repository root copy: no packages/ or .snap/packages/ in $(pwd)"
fi

# (d) model file; OUT stays as given
export GGUF="${KVARN_GPU_FILES:-$_ks_parts/files}/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$GGUF" ] || echo "setup: warning: $GGUF not found (was its file part carried?)"

# (e) versions
if _ks_v=$(python3 -c "import vllm, kvarn_vllm; print(vllm.__version__)" 2>>"$_ks_log"); then
  echo "setup: vllm $_ks_v, kvarn_vllm imports"
else
  _ks_fail "import vllm, kvarn_vllm"
fi
if [ -f .snap/GIT_SHA ]; then
  echo "setup: snapshot $(cat .snap/GIT_SHA)"
elif [ -d .snap ]; then
  echo "setup: warning: .snap/GIT_SHA not found"
fi

# (f) scripts of a snapshot run from .snap and refer to ../tools/gpu
if [ -d .snap ]; then
  if cd .snap 2>/dev/null; then
    echo "setup: cwd $(pwd); KVARN_SETUP_OK=$KVARN_SETUP_OK"
  else
    _ks_fail "cd .snap"
  fi
else
  echo "setup: cwd $(pwd); KVARN_SETUP_OK=$KVARN_SETUP_OK"
fi
unset -f _ks_fail _ks_step
unset _ks_log _ks_v _ks_parts _ks_pkgs
