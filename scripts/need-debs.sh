#!/usr/bin/env bash
# Installs the Debian packages named that are not installed yet (apt-get, with sudo when
# not root); prints what it installs on stderr. Used by the scripts that need packages.
#
#   scripts/need-debs.sh PKG...
set -euo pipefail
missing=()
for pkg in "$@"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
echo "installing: ${missing[*]}" >&2
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
