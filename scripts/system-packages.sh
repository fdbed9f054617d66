#!/usr/bin/env bash
# Install the Debian packages some tests use (restic for the restic example,
# chromium for the fleet page's browser test), when this machine can: apt-get
# present and root (or password-less sudo). Otherwise say so and carry on: the
# tests that need a missing package skip, naming it.
set -u
want=("$@")
missing=()
for pkg in "${want[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system packages: no apt-get here; not installing ${missing[*]} (their tests skip)"
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "system packages: not root; not installing ${missing[*]} (their tests skip)." \
         "To run them: sudo apt-get install ${missing[*]}"
    exit 0
fi
echo "system packages: installing ${missing[*]}..."
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq >/dev/null 2>&1 || true
for pkg in "${missing[@]}"; do
    if ! "${as_root[@]}" apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1; then
        echo "system packages: $pkg could not be installed (its tests skip)"
    fi
done
exit 0
