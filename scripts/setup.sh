#!/usr/bin/env bash
# Create .venv and install the pinned stack (pyproject.toml: dependencies and the test and profile
# extras) plus this project, editable. Idempotent: a stamp holding the hash of every install input
# makes a re-run with nothing changed return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.torchrec_tpu_setup_stamp"

inputs_hash() {
    cat pyproject.toml packaging/fbgemm-gpu-cpu-alias/pyproject.toml scripts/setup.sh \
        | sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

echo "[setup] installing the pinned stack into $VENV (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
# This machine's pip config lists local mirror folders that may be absent; their warnings are noise.
# pip's lines that say how far it is (each package collected or downloaded, the install, the
# result), so no minute of a first setup is silent; "already satisfied" and build detail left out.
progress() { { grep --line-buffered -E "^ *(Collecting|Downloading|Installing collected|Successfully installed)" \
    || true; } | sed -u -E 's/^ */[setup] /; s/^(.{200}).+/\1.../'; }
pip_install() { "${PIP[@]}" --progress-bar off "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
    | progress; }
# The README's install line, editable and with the test and profile extras. The alias folder
# satisfies torchrec's CUDA `fbgemm-gpu` requirement with fbgemm-gpu-cpu (packaging/README.md).
pip_install ./packaging/fbgemm-gpu-cpu-alias -e ".[test,profile]"
"$VENV/bin/python" - <<'PY'
import fbgemm_gpu, jax, matplotlib, mlperf_logging.mllog, pyarrow, ray, ray.train, torch, torchrec, xprof  # noqa: F401  (fail here, not mid-job)
assert torch.__version__.startswith("2.13.0"), torch.__version__
PY
"$VENV/bin/ruff" --version >/dev/null  # the linter ./dev.sh test runs (test extra)
echo "$want" > "$STAMP"
echo "[setup] done"
