#!/usr/bin/env bash
# Install weight of each grammar library of `superinfer bench grammar`: what `pip install`
# adds to an environment that already has torch and superinfer (site-packages KiB before and
# after, and the distributions it pulled). llguidance, a dependency, is taken out first and put
# back; xgrammar and outlines-core are each measured on that same base, and both are left
# installed for the benchmark. xgrammar is installed without its dependencies, then those it
# imports: its requirements also name triton (Linux x86_64), a GPU compiler of several hundred
# MB that a CPU install does not need, and torch, which the base already has.
#
#   bash bench/micro/grammar_weight.sh VENV > weights.json
set -euo pipefail
venv=$1
XGRAMMAR_DEPS=(apache-tvm-ffi pydantic transformers numpy typing-extensions)
py="$venv/bin/python"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

size() { du -sk "$site" | cut -f1; }
dists() { "$py" -m pip list --format=freeze 2>/dev/null | sort; }

install() {
    case $1 in
    xgrammar) "$py" -m pip install -q --no-deps xgrammar >&2 && "$py" -m pip install -q "${XGRAMMAR_DEPS[@]}" >&2 ;;
    *) "$py" -m pip install -q "$1" >&2 ;;
    esac
}

# measure NAME -> its JSON entry; the pulled distributions stay installed
measure() {
    local name=$1 before list_before pulled
    before=$(size)
    list_before=$(dists)
    install "$name"
    pulled=$(comm -13 <(echo "$list_before") <(dists))
    printf '"%s": {"added_kib": %d, "pulled": [%s]}' "$name" $(($(size) - before)) \
        "$(echo "$pulled" | sed 's/.*/"&"/' | paste -sd, -)"
    LAST_PULLED=$(echo "$pulled" | sed 's/==.*//')
}

"$py" -m pip uninstall -q -y llguidance >&2
echo "{"
measure llguidance
echo ","
measure xgrammar
xgrammar_pulled=$LAST_PULLED
echo ","
"$py" -m pip uninstall -q -y $xgrammar_pulled >&2
measure outlines-core
echo
echo "}"
install xgrammar
