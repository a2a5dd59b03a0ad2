#!/usr/bin/env bash
# Puts a Nix >= 2.18 into a private folder without installing anything system-wide: Debian 13
# ("trixie") nix-bin 2.26.3 and the trixie libraries it links (glibc 2.41 among them; Debian 12
# has 2.36), unpacked with dpkg-deb -x and run through trixie's own dynamic loader.
#
# Usage: scripts/debian-nix.sh [--dir DIR] [--print-bin] [--help]
#   --dir DIR     where to keep it (default: $DEEPEP_NIX_DIR, else target/tools/nix-2.26.3 in
#                 the checkout); a complete earlier unpack there is reused as is
#   --print-bin   print only the folder holding the nix / nix-instantiate wrappers (progress
#                 goes to stderr)
#
# Why: nixpkgs' default.nix refuses Nix older than 2.18 (lib/minfeatures.nix) and Debian 12's
# nix-bin is 2.8. Nothing here needs root: apt-get runs against a private state folder (trixie's
# package index, signed by the Debian archive key in /usr/share/keyrings/debian-archive-keyring.gpg,
# which Debian 12 ships); apt checks every .deb against the SHA256 of that signed index, and
# nix-bin is also checked against the SHA256 pinned below. The library list is the ELF closure of
# trixie's nix binary (every NEEDED library, recursively); after unpacking, the loader must find
# every one of them, else this fails naming the missing library.
#
# The wrappers call the loader with --library-path (not LD_LIBRARY_PATH), so programs Nix starts
# (git, /bin/sh) keep using the host's own libraries.
set -euo pipefail

nix_version=2.26.3+dfsg-1
nix_sha256=06e8338eb0ca303802fcfe4579e184dd308d9fa89f7f0aae5974e21fac8178fb
libs=(libacl1 libarchive13t64 libboost-context1.83.0 libbrotli1 libbsd0 libbz2-1.0 libc6
  libcom-err2 libcpuid17 libcurl3t64-gnutls libffi8 libgc1 libgcc-s1 libgit2-1.9 libgmp10
  libgnutls30t64 libgssapi-krb5-2 libhogweed6t64 libhttp-parser2.9 libidn2-0 libk5crypto3
  libkeyutils1 libkrb5-3 libkrb5support0 libldap2 liblowdown2 liblz4-1 liblzma5 libmbedcrypto16
  libmbedtls21 libmbedx509-7 libmd0 libnettle8t64 libnghttp2-14 libnghttp3-9 libngtcp2-16
  libngtcp2-crypto-gnutls8 libp11-kit0 libpcre2-8-0 libpsl5t64 libreadline8t64 librtmp1
  libsasl2-2 libseccomp2 libsodium23 libsqlite3-0 libssh2-1t64 libssl3t64 libstdc++6 libtasn1-6
  libtinfo6 libunistring5 libxml2 libxxhash0 libzstd1 zlib1g)
mirror=${DEEPEP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${DEEPEP_NIX_DIR:-$repo/target/tools/nix-${nix_version%%+*}}
print_bin=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) [ $# -ge 2 ] || { echo "debian-nix: --dir needs a folder" >&2; exit 2; }; dir=$2; shift ;;
    --print-bin) print_bin=1 ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "debian-nix: unknown argument '$1' (use --dir DIR, --print-bin or --help)" >&2; exit 2 ;;
  esac
  shift
done
say() { if [ "$print_bin" = 1 ]; then echo "$@" >&2; else echo "$@"; fi; }
bin=$dir/bin

if [ ! -f "$dir/.complete" ]; then
  [ "$(uname -m)" = x86_64 ] || { echo "debian-nix: only x86_64 (amd64) is set up here; this is $(uname -m)" >&2; exit 1; }
  for t in apt-get dpkg-deb sha256sum; do
    command -v "$t" >/dev/null 2>&1 || { echo "debian-nix: '$t' not found: this needs a Debian-based system (apt-get, dpkg-deb)" >&2; exit 1; }
  done
  [ -r "$keyring" ] || { echo "debian-nix: $keyring missing: install debian-archive-keyring" >&2; exit 1; }
  start=$(date +%s)
  rm -rf "$dir"
  mkdir -p "$dir"
  apt_dir=$dir/apt
  mkdir -p "$apt_dir"/{lists/partial,archives/partial,etc/apt.conf.d,etc/preferences.d,etc/sources.list.d,debs}
  echo "deb [signed-by=$keyring] $mirror trixie main" >"$apt_dir/etc/sources.list"
  : >"$apt_dir/status"
  apt_opts=(-o "Dir::Etc=$apt_dir/etc" -o "Dir::State=$apt_dir" -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir" -o "Dir::Cache::archives=$apt_dir/archives" -o "Dir::State::status=$apt_dir/status"
    -o APT::Architecture=amd64 -o "APT::Sandbox::User=$(id -un)" -o Debug::NoLocking=1)
  say "debian-nix: reading Debian 13's package index ($mirror, signed) ..."
  # apt-get update exits 0 when the mirror cannot be reached; the index file is what counts.
  if ! apt-get "${apt_opts[@]}" update -qq >"$apt_dir/update.log" 2>&1 || ! compgen -G "$apt_dir/lists/*trixie*_Packages*" >/dev/null; then
    cat "$apt_dir/update.log" >&2
    echo "debian-nix: could not read trixie's package index from $mirror (network? set DEEPEP_DEBIAN_MIRROR to a Debian mirror)" >&2
    exit 1
  fi
  say "debian-nix: downloading nix-bin $nix_version and ${#libs[@]} libraries ..."
  if ! (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" download -qq "nix-bin=$nix_version" "${libs[@]}" >"$apt_dir/download.log" 2>&1); then
    cat "$apt_dir/download.log" >&2
    echo "debian-nix: download failed; if trixie no longer has nix-bin $nix_version, update nix_version," \
      "nix_sha256 and the library list in scripts/debian-nix.sh (apt-cache show nix-bin gives both)" >&2
    exit 1
  fi
  deb=$(ls "$apt_dir/debs"/nix-bin_*.deb)
  got=$(sha256sum "$deb" | cut -d' ' -f1)
  if [ "$got" != "$nix_sha256" ]; then
    echo "debian-nix: $deb has sha256 $got, pinned $nix_sha256: refusing it" >&2
    exit 1
  fi
  mkdir -p "$dir/root"
  for d in "$apt_dir/debs"/*.deb; do dpkg-deb -x "$d" "$dir/root"; done
  debs_kb=$(du -sk "$apt_dir/debs" | cut -f1)
  rm -rf "$apt_dir" "$dir/root/usr/share/doc" "$dir/root/usr/share/man" "$dir/root/usr/share/locale" "$dir/root/usr/share/lintian"
  libdir=$dir/root/usr/lib/x86_64-linux-gnu
  loader=$libdir/ld-linux-x86-64.so.2
  # Every library the nix binary needs must resolve inside the unpack.
  if ! list=$("$loader" --library-path "$libdir" --list "$dir/root/usr/bin/nix" 2>&1) || grep -q 'not found' <<<"$list"; then
    echo "$list" >&2
    echo "debian-nix: trixie's nix needs a library not in the list above; add its package to libs in scripts/debian-nix.sh" >&2
    exit 1
  fi
  mkdir -p "$bin"
  for tool in nix nix-instantiate nix-build nix-store nix-env nix-hash nix-shell nix-prefetch-url; do
    cat >"$bin/$tool" <<EOF
#!/bin/sh
# Debian 13's $tool ($nix_version) with its own libraries; made by scripts/debian-nix.sh.
exec "$loader" --library-path "$libdir" --argv0 "$tool" "$dir/root/usr/bin/$tool" "\$@"
EOF
    chmod +x "$bin/$tool"
  done
  version=$("$bin/nix" --version)
  echo "$version" >"$dir/.complete"
  say "debian-nix: $version in $dir ($(du -sh "$dir" | cut -f1) unpacked from $((debs_kb / 1024)) MB of .debs, $(($(date +%s) - start)) s)"
fi
if [ "$print_bin" = 1 ]; then echo "$bin"; else echo "debian-nix: $(cat "$dir/.complete") in $bin"; fi
