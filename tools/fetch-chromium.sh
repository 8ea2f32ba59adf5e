#!/usr/bin/env bash
# Debian's chromium and chromedriver for the web page's browser test (server/tests/browser.rs),
# installed with apt when missing (skipped when both are there, or with OXIDIFF_SKIP_BROWSER=1).
set -euo pipefail
if [[ "${OXIDIFF_SKIP_BROWSER:-0}" == 1 ]]; then
    exit 0
fi
if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    exit 0
fi
sudo=""
if [[ "$(id -u)" != 0 ]]; then
    sudo="sudo"
fi
echo "fetch-chromium: installing Debian's chromium and chromium-driver"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
/usr/bin/chromium --version
