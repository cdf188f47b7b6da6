#!/usr/bin/env bash
# Install weight of each grammar library of `superinfer bench grammar`: what `pip install`
# adds to an environment that already has torch and superinfer (site-packages KiB before and
# after, and the distributions it pulled). llguidance, a dependency, is taken out first and put
# back; xgrammar and outlines-core are each measured on that same base, and both are left
# installed for the benchmark. Extra pip arguments for xgrammar (e.g. --no-deps plus the
# packages it imports, where its requirements would pull another torch or triton) follow `--`.
#
#   bash bench/micro/grammar_weight.sh VENV [-- XGRAMMAR_PIP_ARGS...] > weights.json
set -euo pipefail
venv=$1
shift
[[ ${1:-} == -- ]] && shift
xgrammar_args=("$@")
py="$venv/bin/python"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

size() { du -sk "$site" | cut -f1; }
dists() { "$py" -m pip list --format=freeze 2>/dev/null | sort; }

# measure NAME PIP_INSTALL_ARGS... -> one JSON line; the pulled distributions stay installed
measure() {
    local name=$1 before list_before pulled
    shift
    before=$(size)
    list_before=$(dists)
    "$py" -m pip install -q "$@" >&2
    pulled=$(comm -13 <(echo "$list_before") <(dists))
    printf '"%s": {"added_kib": %d, "pulled": [%s]}' "$name" $(($(size) - before)) \
        "$(echo "$pulled" | sed 's/.*/"&"/' | paste -sd, -)"
    LAST_PULLED=$(echo "$pulled" | sed 's/==.*//')
}

"$py" -m pip uninstall -q -y llguidance >&2
echo "{"
measure llguidance llguidance
echo ","
measure xgrammar "${xgrammar_args[@]:-xgrammar}"
xgrammar_pulled=$LAST_PULLED
echo ","
"$py" -m pip uninstall -q -y $xgrammar_pulled >&2
measure outlines-core outlines-core
echo
echo "}"
"$py" -m pip install -q "${xgrammar_args[@]:-xgrammar}" >&2
