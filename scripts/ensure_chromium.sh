#!/bin/sh
# Make a chromium available to the playground's browser test (tests/experiments/test_playground.py), which playwright drives
# through the system's executable (its own browser download needs a network this project does not have).
# Tolerant by design: `make test` calls it before pytest and goes on whatever happens here; without a chromium
# the browser test skips and says why. Installs only when none is found, apt-get exists and we are root.
for exe in "${CRISPEDIT_CHROMIUM:-}" chromium chromium-browser google-chrome; do
    [ -n "$exe" ] && command -v "$exe" >/dev/null 2>&1 && exit 0
done
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "ensure_chromium: no chromium and no root apt-get to install it; the playground browser test will skip"
    exit 0
fi
start=$(date +%s)
if DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/tmp/crispedit-apt-chromium.log 2>&1 \
   || { apt-get update -q >>/tmp/crispedit-apt-chromium.log 2>&1 \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >>/tmp/crispedit-apt-chromium.log 2>&1; }; then
    echo "ensure_chromium: installed chromium with apt-get in $(( $(date +%s) - start )) s"
else
    echo "ensure_chromium: apt-get install chromium failed (see /tmp/crispedit-apt-chromium.log); the browser test will skip"
fi
exit 0
