#!/usr/bin/env bash
# Runs the /dev/gdrdrv script the NixOS module installs (modules/lib.nix, gdrdrvNodeScript):
#   1. without a gdrdrv entry in /proc/devices it must fail with a message and create nothing;
#   2. in a private mount namespace with a fake /proc/devices (gdrdrv = major 511) and a tmpfs
#      on /dev it must create a character device 511:0 with the configured mode and group.
# Part 2 needs `unshare -m` (root); it is skipped with a message where that is not allowed.
# Never touches the real /dev: part 1 runs only when the host has no gdrdrv loaded.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

group=$(id -gn)
nix eval --impure --raw --expr \
  "(import $repo/modules/lib.nix).gdrdrvNodeScript { group = \"$group\"; mode = \"0640\"; }" >"$work/node.sh"

if grep -qw gdrdrv /proc/devices; then
  echo "skip: this host has gdrdrv loaded; not running the script against the real /dev"
else
  if bash "$work/node.sh" 2>"$work/err"; then
    echo "FAIL: the script succeeded without a gdrdrv entry in /proc/devices" >&2
    exit 1
  fi
  grep -q "no 'gdrdrv' entry in /proc/devices" "$work/err" || { echo "FAIL: unexpected message: $(cat "$work/err")" >&2; exit 1; }
  echo "ok: refuses without gdrdrv in /proc/devices"
fi

printf 'Character devices:\n  1 mem\n511 gdrdrv\n' >"$work/devices"
if ! unshare -m true 2>/dev/null; then
  echo "skip: unshare -m not permitted here (needs root); device creation not exercised"
  exit 0
fi
# stat: type, major:minor (hex), mode, group
got=$(unshare -m bash -c '
  set -e
  mount --bind "$1/devices" /proc/devices
  mount -t tmpfs none /dev
  bash "$1/node.sh"
  stat -c "%F %t:%T %a %G" /dev/gdrdrv
' _ "$work")
want="character special file 1ff:0 640 $group"
[ "$got" = "$want" ] || { echo "FAIL: /dev/gdrdrv is '$got', expected '$want'" >&2; exit 1; }
echo "ok: creates /dev/gdrdrv ($got)"
