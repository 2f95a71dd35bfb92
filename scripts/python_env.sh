# Sourced by the set-up, test and demo scripts: finds a Python >= 3.12 (megatron-core 0.19 ships
# wheels for 3.12 and 3.13 only) and puts the project's virtual environment, .venv, first on PATH.
# RESIHP_PYTHON names an interpreter to use instead of searching.

find_python() {
    local candidates=()
    [ -n "${RESIHP_PYTHON:-}" ] && candidates+=("$RESIHP_PYTHON")
    candidates+=(python3.13 python3.12 python3 python)
    if command -v pyenv > /dev/null 2>&1; then
        local root
        root=$(pyenv root 2> /dev/null || true)
        for dir in "$root"/versions/3.13* "$root"/versions/3.12*; do
            [ -x "$dir/bin/python" ] && candidates+=("$dir/bin/python")
        done
    fi
    local python
    for python in "${candidates[@]}"; do
        command -v "$python" > /dev/null 2>&1 || [ -x "$python" ] || continue
        # `pyenv` shims answer for versions that are not active: ask the interpreter itself.
        if "$python" -c 'import sys; sys.exit(not (3, 12) <= sys.version_info[:2] < (3, 14))' 2> /dev/null; then
            command -v "$python" 2> /dev/null || echo "$python"
            return 0
        fi
    done
    return 1
}

RESIHP_VENV="$(pwd)/.venv"
export PATH="$RESIHP_VENV/bin:$PATH"
