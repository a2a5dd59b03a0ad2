#!/usr/bin/env bash
# The Nix checks that need neither network (beyond Debian's and the crate registry) nor a GPU
# nor nixpkgs. Runs on a fresh Debian 12 machine without Nix (CI); called by scripts/test-all.sh.
#
#   1. Nix >= 2.18 (nixpkgs' minimum): nix-instantiate from PATH when new enough, else Debian 13's
#      Nix 2.26 unpacked privately by scripts/debian-nix.sh (cached in target/tools/); used
#      without a daemon, build users, substituters or flake registry (offline). Without one this
#      prints a FAIL line and the summary. Checks the version it reports.
#   2. Every .nix file of the checkout parses.
#   3. Pure evaluation tests (checks/pure.nix): the module's rendering helpers, the NVSHMEM
#      release selection, the generated release data.
#   4. The texts of the key evaluation errors (3.3.9 + CUDA 13, PyPI-only release with the
#      NVIDIA source, unknown IBGDA method); the module's /dev/gdrdrv script, run in a private
#      mount namespace with a fake /proc/devices (checks/gdrdrv-node.sh).
#   4b. checks/stub-nixpkgs refuses Nix < 2.18 as nixpkgs' default.nix does (lib/minfeatures.nix):
#      its logic with builtins.nixVersion replaced, and a real Nix 2.8 (Debian 12's apt nix-bin,
#      installed as root when missing; skipped elsewhere).
#   5. The NixOS module: every case of checks/module/cases.nix over the NixOS stand-ins
#      (checks/module/stand-ins.nix) through checks/module/mini-lib.nix (a small module system:
#      nixpkgs cannot be had offline), and also through nixpkgs' real lib.evalModules when a
#      nixpkgs `lib` directory is given in NIXPKGS_LIB; the option-coverage and provenance check
#      (checks/module/coverage.nix), and that it fails when a stand-in is missing or unsourced.
#   6. The flake with nixpkgs replaced by checks/stub-nixpkgs (a tiny stand-in; it cannot build
#      or check real packages): `nix flake show`, `nix flake check --no-build`, attribute names,
#      every package/dev shell derivation and pinned source, the overlay, the module names,
#      DeepEP's pairing refusal / accepted pairing / CUDA-major check through the flake.
#      Our Python package (deepep-kernels-python): maturin hooks, pythonImportsCheck and the
#      kernels' CUDA_HOME/NVSHMEM_DIR through the flake, the `python` dev shell, the overlay's
#      python3Packages.deepep-kernels, and its refusal of a toolkit of another CUDA major.
#      One CUDA major across NVSHMEM, kernels, dev shells and the GPU check (checks/cuda-major.nix,
#      and that it fails when an output takes pkgs.cudaPackages); the unfree package names.
#      The audit against nixpkgs (docs/nix.md, issue 22), over a stub modelling the recipes read:
#      cuda_crt and cccl in every CUDA 13 toolkit root, DeepEP's arch list limited to what torch's
#      extension builder accepts, one NVSHMEM per process (DeepEP and the python shell's binding
#      against torch's NVSHMEM or torch rebuilt without), meta.broken instead of throws (overlay,
#      a torch recipe that predates CUDA 13), and checks/nvshmem-maps.py on real processes
#      (checks/nvshmem-maps-test.sh).
#      With DEEPEP_NVSHMEM_WHEEL set (scripts/test-all.sh sets it), the NVSHMEM package's shell
#      phases also run on that wheel (checks/nvshmem-phases.sh; unzip/patchelf from apt), and the
#      maps test uses its real libnvshmem_host.so.3.
#   6b. pkgs/workspace-src.nix: cargo metadata --offline over exactly the paths it lists (every
#      workspace member present, as the Rust packages need).
#   7. deadnix --fail and nixpkgs-fmt --check over every .nix file: deadnix 1.3.1 and
#      nixpkgs-fmt 1.3.0 exactly, installed with `cargo install --locked --version` into
#      target/tools/cargo-tools when that version is not there yet.
#
# Prints one line per check and a summary; exits 1 if any check failed.
#
# Run as root on Debian, it installs system-wide with apt-get what two checks need and this
# machine lacks: nix-bin (Debian 12's Nix 2.8, check 4b) and unzip/patchelf/binutils (check 6's
# NVSHMEM package phases). DEEPEP_NO_APT=1 installs nothing; those checks are then skipped
# (4b) or run with what is there. --apt-plan prints what a run would install, and exits.
#
# Usage: scripts/nix-checks.sh [--apt-plan] [--help]
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^# Usage:/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --apt-plan|"") ;;
  *) echo "nix-checks: unknown argument '$1' (use --apt-plan or --help)" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "nix-checks: one argument at most (use --apt-plan or --help)" >&2; exit 2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"


failed=()
passed=0
pass() { printf 'ok    %s\n' "$1"; passed=$((passed + 1)); }
fail() { printf 'FAIL  %s\n' "$1"; failed+=("$1"); }
skip() { printf 'skip  %s (%s)\n' "$1" "$2"; }
note() { printf '      %s\n' "$@"; }

# ---------------------------------------------------------------- 1. Nix
# A Nix >= 2.18 (what nixpkgs' lib/minfeatures.nix requires): the one on PATH when it is new
# enough (a user's own install), else Debian 13's 2.26 unpacked privately by scripts/debian-nix.sh
# into target/tools/ (no root needed; reused on the next run). Debian 12's apt Nix is 2.8.
min_nix=2.18
nix_ok() { # VERSION-STRING: true when >= min_nix
  local v; v=$(grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' <<<"$1" | head -n1)
  [ -n "$v" ] && [ "$(printf '%s\n%s\n' "$min_nix" "$v" | sort -V | head -n1)" = "$min_nix" ]
}
# What this run would apt-get install system-wide (root on Debian only; none with DEEPEP_NO_APT=1).
apt_plan() {
  [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 && [ "${DEEPEP_NO_APT:-0}" != 1 ] || return 0
  local old=""
  for c in /usr/bin/nix-instantiate $(type -ap nix-instantiate); do
    if [ -x "$c" ] && ! nix_ok "$("$c" --version 2>/dev/null)"; then old=$c; break; fi
  done
  if [ -z "$old" ] && grep -q '^VERSION_CODENAME=bookworm' /etc/os-release 2>/dev/null; then echo nix-bin; fi
  if [ -n "${DEEPEP_NVSHMEM_WHEEL:-}" ]; then
    command -v unzip >/dev/null 2>&1 || echo unzip
    command -v patchelf >/dev/null 2>&1 || echo patchelf
    command -v readelf >/dev/null 2>&1 || echo binutils
  fi
  return 0
}
if [ "${1:-}" = --apt-plan ]; then apt_plan; exit 0; fi
nix_summary_fail() { # MESSAGE: the countable summary when no usable Nix exists, then exit 1
  fail "$1"
  echo
  echo "nix checks: $passed passed, ${#failed[@]} failed"
  exit 1
}
if command -v nix-instantiate >/dev/null 2>&1 && nix_ok "$(nix-instantiate --version 2>/dev/null)"; then
  nix_from="PATH ($(command -v nix-instantiate))"
elif nix_bin=$(bash scripts/debian-nix.sh --print-bin || true) && [ -n "$nix_bin" ] && [ -x "$nix_bin/nix-instantiate" ]; then
  export PATH="$nix_bin:$PATH"
  nix_from="scripts/debian-nix.sh ($nix_bin)"
else
  have=$(nix-instantiate --version 2>/dev/null || echo "none")
  nix_summary_fail "Nix >= $min_nix: not on PATH (nix-instantiate there: $have) and scripts/debian-nix.sh could not unpack Debian 13's Nix (its error is above); install Nix >= $min_nix (https://nixos.org/download) or make deb.debian.org reachable"
fi
# Offline, single-user, no daemon: no substituters (no cache to reach), no flake registry,
# no build-users group (none exists), no sandbox (Debian's build has no sandbox paths).
export NIX_CONFIG='experimental-features = nix-command flakes
substituters =
flake-registry =
build-users-group =
sandbox = false'
nix_version=$(nix --version)
if nix_ok "$nix_version"; then
  pass "Nix >= $min_nix: $nix_version from $nix_from"
else
  nix_summary_fail "Nix >= $min_nix: $nix_version from $nix_from is older; nixpkgs refuses it"
fi

# Every .nix file of the checkout: tracked ones plus new, not ignored ones.
mapfile -d '' nix_files < <(git ls-files -z --cached --others --exclude-standard -- '*.nix')

log=$(mktemp)
trap 'rm -f "$log"' EXIT

# ---------------------------------------------------------------- 2. parse
bad=()
for f in "${nix_files[@]}"; do
  [ -e "$f" ] || continue
  nix-instantiate --parse "$f" >/dev/null 2>"$log" || { bad+=("$f"); cat "$log"; }
done
if [ ${#bad[@]} -eq 0 ]; then pass "parse ${#nix_files[@]} .nix files"; else fail "parse: ${bad[*]}"; fi

# ---------------------------------------------------------------- 3. pure tests
if out=$(nix-instantiate --eval --strict --json checks/pure.nix 2>"$log"); then
  pass "pure evaluation tests ($(printf '%s' "$out" | grep -o '"passed":[0-9]*' | cut -d: -f2) passed)"
else
  fail "pure evaluation tests"; grep -v "^warning:" "$log" || true
fi

# ---------------------------------------------------------------- 4. error texts
# expect_error NAME EXPR TEXT: evaluating EXPR must fail with TEXT in the message.
expect_error() {
  if nix-instantiate --eval --strict -E "$2" >/dev/null 2>"$log"; then
    fail "$1: evaluated, expected an error"
  elif grep -qF -- "$3" "$log"; then
    pass "$1"
  else
    fail "$1: message lacks: $3"; grep -v "^warning:" "$log" || true
  fi
}
sel="let n = import $repo/pkgs/nvshmem/lib.nix; r = import $repo/pkgs/nvshmem/releases.nix; in a: (n.select ({ releases = r; system = \"x86_64-linux\"; } // a)).artifact.url"
expect_error "error: 3.3.9 with CUDA 13" "($sel) { version = \"3.3.9\"; cudaMajor = \"13\"; }" \
  "NVSHMEM 3.3.9 has no CUDA 13 build for x86_64-linux; the first is 3.3.20; use nvshmem_3_3_9_cuda12"
expect_error "error: PyPI-only release with source = nvidia" "($sel) { version = \"3.8.0\"; source = \"nvidia\"; }" \
  'has no NVIDIA tarball in the release data; available: "pypi"; use .override { source = "pypi"; }'
expect_error "error: unknown IBGDA method" "(import $repo/modules/lib.nix).methodFeatures \"gpu\"" \
  'use one of: "both", "driver", "gdrcopy", "none"'

# The /dev/gdrdrv script the module installs, run for real (checks/gdrdrv-node.sh).
if out=$(bash checks/gdrdrv-node.sh 2>"$log"); then
  pass "gdrdrv device-node script: $(tr '\n' ' ' <<<"$out")"
else
  fail "gdrdrv device-node script"; printf '%s\n' "${out:-}"; cat "$log"
fi

# ------------------------------------------ 4b. the stand-in nixpkgs refuses Nix < 2.18
# checks/stub-nixpkgs gates on checks/stub-nixpkgs/minfeatures.nix as nixpkgs' default.nix gates
# on lib/minfeatures.nix. First the gate's logic, evaluated by the Nix above with
# builtins.nixVersion replaced (scopedImport); then a real Nix 2.8 (Debian 12's apt nix-bin).
stub_with() { # NIXVERSION-OVERRIDE-EXPR: the stub's config, evaluated under that builtins
  echo "(scopedImport { builtins = $1; } $repo/checks/stub-nixpkgs/default.nix { system = \"x86_64-linux\"; config.probe = true; }).config.probe"
}
expect_error "stub nixpkgs refuses builtins.nixVersion = 2.8.0 (logic)" \
  "$(stub_with 'builtins // { nixVersion = "2.8.0"; }')" \
  "You are evaluating with Nix 2.8.0. Use a Nix >= 2.18"
expect_error "stub nixpkgs refuses builtins.nixVersion = 2.17.1 (logic)" \
  "$(stub_with 'builtins // { nixVersion = "2.17.1"; }')" \
  "- \`builtins.nixVersion\` reports at least 2.18"
expect_error "stub nixpkgs refuses a Nix without builtins.nixVersion (logic)" \
  "$(stub_with 'removeAttrs builtins [ "nixVersion" ]')" \
  "- the \`nixVersion\` builtin"
if out=$(nix-instantiate --eval --strict -E "[ ($(stub_with 'builtins // { nixVersion = "2.18.3-lix"; }')) ($(stub_with 'builtins // { nixVersion = "2.18"; }')) ($(stub_with builtins)) ]" 2>"$log") \
  && [ "$out" = "[ true true true ]" ]; then
  pass "stub nixpkgs accepts 2.18, Lix's \"2.18.3-lix\" and $(nix-instantiate --eval -E builtins.nixVersion 2>/dev/null)"
else
  fail "stub nixpkgs accepts Nix >= 2.18: ${out:-}"; grep -v "^warning:" "$log" || true
fi
old_nix=
for c in /usr/bin/nix-instantiate $(type -ap nix-instantiate); do
  if [ -x "$c" ] && ! nix_ok "$("$c" --version 2>/dev/null)"; then old_nix=$c; break; fi
done
if [ -z "$old_nix" ] && apt_plan | grep -qx nix-bin; then
  echo "installing Debian 12's nix-bin (Nix 2.8) to show the stand-in refusing it ..."
  # A fresh machine may have no package lists yet: update only then.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nix-bin >"$log" 2>&1 \
    || { apt-get update -qq >"$log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nix-bin >"$log" 2>&1; } \
    || cat "$log"
  [ -x /usr/bin/nix-instantiate ] && ! nix_ok "$(/usr/bin/nix-instantiate --version 2>/dev/null)" && old_nix=/usr/bin/nix-instantiate
fi
if [ -n "$old_nix" ]; then
  old_version=$("$old_nix" --version)
  # --store dummy://: the old Nix leaves the store (and its database) of the new one alone.
  if "$old_nix" --store dummy:// --eval -E "(import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; }).config" >/dev/null 2>"$log"; then
    fail "stub nixpkgs refuses a real $old_version: it evaluated"
  elif grep -qF 'reports at least 2.18' "$log" && grep -qF "You are evaluating with Nix ${old_version##* }." "$log"; then
    pass "stub nixpkgs refuses a real $old_version ($old_nix), as nixpkgs does"
  else
    fail "stub nixpkgs with a real $old_version: unexpected error"; cat "$log"
  fi
else
  skip "stub nixpkgs refuses a real Nix < 2.18" "none here (as root on Debian 12 this installs apt's nix-bin 2.8 unless DEEPEP_NO_APT=1); the gate's logic is tested above"
fi

# ---------------------------------------------------------------- 5. the NixOS module
mini="import $repo/checks/module/mini-lib.nix"
module_cases() { # LABEL LIB-EXPR
  if out=$(nix-instantiate --eval --strict --json checks/module/lib-eval.nix --arg lib "$2" 2>"$log"); then
    pass "module cases over the NixOS stand-ins, $1: $(grep -o '"ok"' <<<"$out" | wc -l) cases ok"
  else
    fail "module cases over the NixOS stand-ins, $1"; grep -v "^warning:" "$log" || true
  fi
}
module_cases "checks/module/mini-lib.nix" "$mini"
if [ -n "${NIXPKGS_LIB:-}" ]; then
  module_cases "nixpkgs' lib.evalModules" "import ${NIXPKGS_LIB}"
else
  skip "module cases through nixpkgs' lib.evalModules" "set NIXPKGS_LIB=<nixpkgs>/lib to run them there too"
fi
if out=$(nix-instantiate --eval --strict --json checks/module/coverage.nix --arg lib "$mini" 2>"$log"); then
  pass "option coverage and provenance of the stand-ins: $(printf '%s' "$out" | grep -o '"defines":\[[^]]*\]' | grep -o '","' | wc -l | awk '{print $1 + 1}') option paths defined, $(printf '%s' "$out" | grep -o '"reads":\[[^]]*\]' | grep -o '","' | wc -l | awk '{print $1 + 1}') read, all declared"
else
  fail "option coverage and provenance of the stand-ins"; grep -v "^warning:" "$log" || true
fi
# The stand-in module system refuses what nixpkgs' refuses (the cases above rely on it).
mini_eval="m: ($mini).evalModules { modules = [ { options.a = ($mini).mkOption { type = ($mini).types.bool; default = false; }; } m ]; }"
expect_error "mini-lib: an undeclared option is an error also under mkIf false" \
  "(($mini_eval) { config = ($mini).mkIf false { b.c = 1; }; }).config.a" "b' does not exist. Definition values"
expect_error "mini-lib: a definition of the wrong type is an error" \
  "(($mini_eval) { a = \"yes\"; }).config.a" "a' is not of type"
# The coverage check must fail when a stand-in the module needs is missing, or has no source.
cov="a: import $repo/checks/module/coverage.nix ({ lib = $mini; } // a)"
standins="import $repo/checks/module/stand-ins.nix { }"
expect_error "option coverage fails without the modprobe.nix stand-in" \
  "($cov) { standIns = builtins.filter (s: s.mirrors != \"nixos/modules/system/boot/modprobe.nix\") ($standins); }" \
  "modules/deepep.nix defines boot.extraModprobeConfig, which no stand-in declares"
expect_error "option coverage fails without the kernel.nix stand-in" \
  "($cov) { standIns = builtins.filter (s: s.mirrors != \"nixos/modules/system/boot/kernel.nix\") ($standins); }" \
  "modules/deepep.nix reads config.boot.kernelParams, which is no declared option"
expect_error "provenance fails for a stand-in without its nixpkgs file" \
  "($cov) { standIns = map (s: removeAttrs s [ \"mirrors\" ]) ($standins); }" \
  "names no nixpkgs file"

# ---------------------------------------------------------------- 6. flake structure
if [ -f checks/stub-nixpkgs/flake.nix ]; then
  stub=(--override-input nixpkgs "path:$repo/checks/stub-nixpkgs" --no-write-lock-file)
  if nix flake show "${stub[@]}" >"$log" 2>&1; then
    pass "nix flake show (stub nixpkgs)"
  else
    fail "nix flake show (stub nixpkgs)"; cat "$log"
  fi
  # Evaluates every output (checks included: the pure tests run again inside it); the checks
  # that need real nixpkgs (lib.evalModules, NixOS) are absent against the stub.
  if nix flake check --no-build "${stub[@]}" >"$log" 2>&1; then
    pass "nix flake check --no-build (stub nixpkgs)"
  else
    fail "nix flake check --no-build (stub nixpkgs)"; grep -v "^warning:" "$log" || true
  fi
  for sys in x86_64-linux aarch64-linux; do
    if out=$(nix eval --json "${stub[@]}" ".#packages.$sys" --apply builtins.attrNames 2>"$log"); then
      missing=()
      for want in default nvshmem nvshmem_3_3_9 nvshmem_3_3_9_cuda12 nvshmem_3_4_5_cuda13 nvshmem_3_8_0 gdrcopy deepep-kernels deepep-kernels-no-nvshmem deepep-nix deep-ep deep-ep-no-nvshmem deepep-kernels-python; do
        grep -q "\"$want\"" <<<"$out" || missing+=("$want")
      done
      unwanted=$(grep -o '"nvshmem_3_3_9_cuda13"' <<<"$out" || true)
      if [ ${#missing[@]} -eq 0 ] && [ -z "$unwanted" ]; then pass "packages.$sys attribute names"; else fail "packages.$sys: missing ${missing[*]} ${unwanted:+, has $unwanted}"; fi
    else
      fail "packages.$sys"; cat "$log"
    fi
  done
  # Every package's derivation (with the stub builders), and every NVSHMEM attribute's source
  # both as chosen by default and as the PyPI wheel: each is a fixed-output fetchurl, so this
  # checks every pinned URL and hash the flake can reach.
  for sys in x86_64-linux aarch64-linux; do
    apply='ps: let
      names = builtins.filter (n: builtins.substring 0 7 n == "nvshmem") (builtins.attrNames ps);
      drvs = builtins.attrValues (builtins.mapAttrs (_: p: p.drvPath) ps);
      srcs = map (n: [ ps.${n}.src.drvPath (ps.${n}.override { source = "pypi"; }).src.drvPath ]) names;
    in "${toString (builtins.length drvs)} derivations, ${toString (builtins.length srcs)} NVSHMEM attributes x 2 sources"'
    if out=$(nix eval --raw "${stub[@]}" ".#packages.$sys" --apply "$apply" 2>"$log"); then
      pass "packages.$sys evaluate: $out"
    else
      fail "packages.$sys evaluate"; grep -v "^warning:" "$log" || true
    fi
    if out=$(nix eval --json "${stub[@]}" ".#devShells.$sys" --apply 'ds: builtins.mapAttrs (_: d: d.drvPath) ds' 2>"$log"); then
      pass "devShells.$sys evaluate"
    else
      fail "devShells.$sys evaluate"; grep -v "^warning:" "$log" || true
    fi
  done
  # One CUDA major for NVSHMEM, the kernels, the dev shells' nvcc and the GPU check's NCCL
  # (checks/cuda-major.nix; the stub's pkgs.cudaPackages is CUDA 12, as at many nixpkgs
  # revisions, so anything taking the toolkit from the scope shows up here).
  for sys in x86_64-linux aarch64-linux; do
    if out=$(nix eval --raw "${stub[@]}" ".#checks.$sys.cuda-major.result" 2>"$log"); then
      pass "one CUDA major ($sys): $(grep -o 'CUDA [0-9]*' <<<"$out" | sort | uniq -c | tr -s ' ' | tr '\n' ' ')"
    else
      fail "one CUDA major ($sys)"; grep -v "^warning:" "$log" || true
    fi
  done
  # ... and the check fails when an output takes the toolkit from the scope: the kernels
  # without NVSHMEM and a dev shell built with pkgs.cudaPackages (what callPackage fills in).
  stubpkgs="import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; }"
  expect_error "one CUDA major: fails for an output with pkgs.cudaPackages" "let
      pkgs = $stubpkgs; ours = import $repo/pkgs { inherit pkgs; };
      shell = pkgs.mkShell { packages = [ pkgs.cudaPackages.cuda_nvcc ]; };
    in import $repo/checks/cuda-major.nix {
      inherit pkgs; inherit (ours) cudaMajor;
      packages = ours.packages // { deepep-kernels-no-nvshmem = pkgs.callPackage $repo/pkgs/deepep-kernels/package.nix { nvshmem = null; }; };
      devShells = { default = shell; no-nvshmem = shell; };
      gpuChecks.kernels = ours.packages.deepep-kernels.gpuCheck;
    }" "packages.deepep-kernels-no-nvshmem (toolkit): 12, expected 13"
  expect_error "deepep-kernels refuses NVSHMEM and a toolkit of different CUDA majors" \
    "let pkgs = $stubpkgs; ours = import $repo/pkgs { inherit pkgs; }; in (pkgs.callPackage $repo/pkgs/deepep-kernels/package.nix { inherit (ours.packages) nvshmem; }).drvPath" \
    "NVSHMEM 3.4.5 is the CUDA 13 build but cudaPackages is CUDA 12"
  if out=$(nix eval --json "${stub[@]}" .#checks.x86_64-linux.unfree-names.result 2>"$log"); then
    pass "allowUnfreePredicate: the driver packages' real pnames (nvidia-x11, nvidia-dc, nvidia-settings, nvidia-persistenced, fabricmanager, nvidia-kernel-modules)"
  else
    fail "allowUnfreePredicate names"; grep -v "^warning:" "$log" || true
  fi
  if nix eval --raw "${stub[@]}" .#packages.x86_64-linux --apply 'ps: (ps.nvshmem_3_3_9.override { cudaMajor = "13"; }).drvPath' >/dev/null 2>"$log"; then
    fail "nvshmem_3_3_9.override { cudaMajor = \"13\"; } evaluated"
  elif grep -qF "NVSHMEM 3.3.9 has no CUDA 13 build" "$log"; then
    pass "nvshmem_3_3_9.override { cudaMajor = \"13\"; } is refused"
  else
    fail "nvshmem_3_3_9.override { cudaMajor = \"13\"; }: unexpected error"; cat "$log"
  fi
  # DeepEP (pkgs/deep-ep): a known-broken DeepEP x NVSHMEM pairing is refused with the fix in
  # the message; the default pairing is accepted and known good; a CUDA-major mismatch between
  # torch and NVSHMEM is refused; the intranode-only build leaves NVSHMEM_DIR unset.
  deepep_eval() { nix eval --raw "${stub[@]}" .#packages.x86_64-linux --apply "$1" 2>"$log"; }
  # expect_refused EXPR WHAT TEXT1 TEXT2 NAMING: EXPR must not evaluate; its error holds both texts
  expect_refused() {
    if deepep_eval "$1" >/dev/null; then
      fail "$2 evaluated, expected it refused"
    elif grep -qF "$3" "$log" && grep -qF "$4" "$log"; then
      pass "$2 is refused, naming $5"
    else
      fail "$2: unexpected error"; cat "$log"
    fi
  }
  expect_refused 'ps: (ps.deep-ep.override { nvshmem = ps.nvshmem_3_6_5; }).drvPath' \
    'deep-ep.override { nvshmem = nvshmem_3_6_5; } (a known-broken pairing)' \
    'DeepEP 1.2.1 with NVSHMEM 3.6.5 is a known-broken pairing' 'Fix: pin NVSHMEM <= 3.4.5 (nvshmem_3_4_5' "the fix"
  if out=$(deepep_eval 'ps: "${ps.deep-ep.pairing} ${ps.deep-ep.nvshmem.version} ${ps.deep-ep.TORCH_CUDA_ARCH_LIST} ${builtins.baseNameOf ps.deep-ep.drvPath}"') \
    && [[ "$out" == "good 3.4.5 9.0;10.0;10.3;12.0;12.1 "*-deep-ep-1.2.1.drv ]]; then
    pass "deep-ep: DeepEP 1.2.1 + NVSHMEM 3.4.5 accepted ($out)"
  else
    fail "deep-ep default pairing: ${out:-}"; grep -v "^warning:" "$log" || true
  fi
  if out=$(deepep_eval 'ps: let d = ps.deep-ep.override { nvshmem = ps.nvshmem_3_4_5_cuda12; }; in builtins.toJSON [ d.meta.broken (builtins.attrNames d.brokenConditions) ]') \
    && grep -qF '[true,["deep-ep: torch is built for CUDA 13 but NVSHMEM 3.4.5 for CUDA 12' <<<"$out"; then
    pass "deep-ep with torch CUDA 13 and NVSHMEM CUDA 12 is meta.broken, the reason in brokenConditions"
  else
    fail "deep-ep CUDA-major mismatch: ${out:-}"; grep -v "^warning:" "$log" || true
  fi
  if out=$(deepep_eval 'ps: "${ps.deep-ep-no-nvshmem.pairing} ${ps.deep-ep-no-nvshmem.NVSHMEM_DIR or "unset"} ${ps.deep-ep-no-nvshmem.DISABLE_SM90_FEATURES}"') && [ "$out" = "no-nvshmem unset 0" ]; then
    pass "deep-ep-no-nvshmem: NVSHMEM_DIR unset"
  else
    fail "deep-ep-no-nvshmem: ${out:-}"; grep -v "^warning:" "$log" || true
  fi
  # Our Python package (pkgs/deepep-kernels-python): built with nixpkgs' maturin support in
  # python/, imports checked, and with exactly the kernels' CUDA_HOME, NVSHMEM_DIR and nvcc
  # flags (the same store paths as packages.deepep-kernels).
  pykernels_apply="ps: let p = ps.deepep-kernels-python; k = ps.deepep-kernels; hooks = map (h: h.name or \"\") p.nativeBuildInputs; in [
      (builtins.baseNameOf p.drvPath) p.pyproject p.buildAndTestSubdir p.pythonImportsCheck
      (builtins.elem \"maturin-build-hook.sh\" hooks && builtins.elem \"cargo-setup-hook.sh\" hooks)
      (builtins.hashFile \"sha256\" p.cargoDeps.lockFile == \"$(sha256sum Cargo.lock | cut -d' ' -f1)\")
      (p.env.CUDA_HOME == k.env.CUDA_HOME) (p.env.NVSHMEM_DIR == k.env.NVSHMEM_DIR) (p.env.DEEPEP_NVCC_FLAGS == k.env.DEEPEP_NVCC_FLAGS)
      p.nvshmem.version p.cudaPackages.cudaMajorVersion ]"
  if out=$(nix eval --json "${stub[@]}" .#packages.x86_64-linux --apply "$pykernels_apply" 2>"$log") \
    && [[ "$out" == '["'*'-deepep-kernels-0.1.0.drv",true,"python",["deepep_kernels"],true,true,true,true,true,"3.4.5","13"]' ]]; then
    pass "deepep-kernels-python: maturinBuildHook in python/, pythonImportsCheck deepep_kernels, the kernels' CUDA_HOME/NVSHMEM_DIR ($out)"
  else
    fail "deepep-kernels-python through the flake: ${out:-}"; grep -v "^warning:" "$log" || true
  fi
  # The `python` dev shell holds deepep_kernels (built as above) in its Python environment.
  if out=$(nix eval --json "${stub[@]}" .#devShells.x86_64-linux.python --apply 's: let env = builtins.head s.nativeBuildInputs; in [
      (builtins.all (d: builtins.elem d.outPath (builtins.filter builtins.isString (builtins.split " " env.paths))) [ s.deepepKernels s.torch ]) s.torch.cudaSupport
      (s.deepepKernels.env.NVSHMEM_DIR == s.deepepKernels.nvshmem.outPath) s.deepepKernels.pythonImportsCheck ]' 2>"$log") \
    && [ "$out" = '[true,true,true,["deepep_kernels"]]' ]; then
    pass "devShells.python: Python with deepep_kernels and a CUDA torch ($out)"
  else
    fail "devShells.python: ${out:-}"; grep -v "^warning:" "$log" || true
  fi
  # Broken on purpose: built with the scope's toolkit (pkgs.cudaPackages, what callPackage fills
  # in when pkgs/default.nix does not pass cudaPackages) it is refused against the CUDA 13
  # NVSHMEM, and without NVSHMEM the one-CUDA-major check names it.
  expect_error "deepep-kernels-python refuses NVSHMEM and a toolkit of different CUDA majors" \
    "let pkgs = $stubpkgs; ours = import $repo/pkgs { inherit pkgs; }; in (pkgs.python3Packages.callPackage $repo/pkgs/deepep-kernels-python/package.nix { inherit (ours.packages) nvshmem; }).drvPath" \
    "deepep-kernels-python: NVSHMEM 3.4.5 is the CUDA 13 build but cudaPackages is CUDA 12"
  expect_error "one CUDA major: fails for deepep-kernels-python with pkgs.cudaPackages" "let
      pkgs = $stubpkgs; ours = import $repo/pkgs { inherit pkgs; };
      shell = pkgs.mkShell { packages = [ pkgs.cudaPackages_13.cuda_nvcc ]; };
    in import $repo/checks/cuda-major.nix {
      inherit pkgs; inherit (ours) cudaMajor;
      packages = ours.packages // { deepep-kernels-python = pkgs.python3Packages.callPackage $repo/pkgs/deepep-kernels-python/package.nix { nvshmem = null; }; };
      devShells = { default = shell; no-nvshmem = shell; };
      gpuChecks.kernels = ours.packages.deepep-kernels.gpuCheck;
    }" "packages.deepep-kernels-python (toolkit): 12, expected 13"
  # python3Packages.deep-ep from the overlay, on stub package sets: with a CPU torch and with a
  # torch of CUDA 12 (the stub's default) against the CUDA 13 `nvshmem` it is meta.broken with the
  # reason in passthru.brokenConditions, as nixpkgs' own deep-ep is for a CPU torch (evaluating the
  # package set never throws); from cudaPackages_13.pkgs it works.
  pyoverlay_expr="let
      flake = builtins.getFlake \"git+file://$repo\";
      withOverlay = prev: let final = prev // flake.overlays.default final prev; in final;
      cpu = import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; };
      cuda = import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; config.cudaSupport = true; };
      pyDeepEp = f: ((builtins.head f.pythonPackagesExtensions) f.python3Packages { }).deep-ep;
      has = re: d: builtins.any (r: builtins.match re r != null) (builtins.attrNames d.brokenConditions);
      a = pyDeepEp (withOverlay cpu); b = pyDeepEp (withOverlay cuda); c = pyDeepEp (withOverlay cuda.cudaPackages_13.pkgs);
    in [ a.meta.broken (has \".*torch given is built without CUDA.*\" a) b.meta.broken (has \".*torch is built for CUDA 12 but NVSHMEM 3.4.5 for CUDA 13.*\" b)
         (builtins.tryEval b.drvPath).success c.meta.broken c.pairing ]"
  if out=$(nix eval --impure --json --expr "$pyoverlay_expr" 2>"$log") && [ "$out" = '[true,true,true,true,true,false,"good"]' ]; then
    pass "overlays.default python3Packages.deep-ep: meta.broken with the reason for a CPU torch and a CUDA 12 torch, not a throw; works from cudaPackages_13.pkgs ($out)"
  else
    fail "overlays.default python3Packages.deep-ep: ${out:-}"; grep -v "^warning:" "$log" || true
  fi

  # The audit of issue 22 (docs/nix.md, "Audit against nixpkgs"), each against the stub modelling
  # the nixpkgs recipes read (checks/stub-nixpkgs/pkgs.nix `torch`):
  # CUDA 13 toolkit roots hold cuda_crt (crt/host_config.h lives only there from CUDA 13) ahead of
  # nvcc, and CCCL as `cccl` (cuda_cccl is an alias in CUDA 13.3 sets; the stub's throws).
  home_expr='ps: let
      paths = h: builtins.filter (x: x != "") (builtins.filter builtins.isString (builtins.split " " h.paths));
      first = h: builtins.baseNameOf (builtins.head (paths h));
      ok = h: builtins.match ".*-cuda_crt-13.*" (first h) != null && builtins.any (p: builtins.match ".*-cccl-13$" p != null) (paths h);
    in [ (ok ps.deepep-kernels.cudaHome) (ok ps.deepep-kernels-python.cudaHome) (ok ps.gdrcopy.cudaRoot) (ok ps.deep-ep.cudaHome) ]'
  if out=$(nix eval --json "${stub[@]}" .#packages.x86_64-linux --apply "$home_expr" 2>"$log") && [ "$out" = '[true,true,true,true]' ]; then
    pass "CUDA 13 toolkit roots (kernels, Python package, gdrcopy, DeepEP): cuda_crt first, cccl not the cuda_cccl alias"
  else
    fail "CUDA 13 toolkit roots: ${out:-}"; grep -v "^warning:" "$log" | tail -5 || true
  fi
  # TORCH_CUDA_ARCH_LIST holds only what torch's extension builder accepts: nixpkgs' torch 2.13
  # passes the whole capability list (7.5 ... 11.0, 12.1), torch 2.9 narrowed it itself; 11.0 is
  # in neither allowlist, 10.3/12.1 only from torch 2.8 on (a torch 2.7 recipe: 9.0;10.0;12.0).
  arch_expr="let
      deepEpWith = torch: (import $repo/pkgs { pkgs = import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; inherit torch; }; }).packages.deep-ep;
      d = deepEpWith { };
      old = deepEpWith { version = \"2.7.1\"; withNvshmem = false; cudaMajors = [ \"11\" \"12\" \"13\" ]; narrowedCapabilities = true; };
    in [ d.TORCH_CUDA_ARCH_LIST d.droppedCudaCapabilities old.TORCH_CUDA_ARCH_LIST
         (builtins.match \".*check-arch-list.py.*\" d.preBuild != null) ]"
  if out=$(nix eval --impure --json --expr "$arch_expr" 2>"$log") \
    && [ "$out" = '["9.0;10.0;10.3;12.0;12.1",["7.5","8.0","8.6","8.9","11.0"],"9.0;10.0;12.0",true]' ]; then
    pass "deep-ep TORCH_CUDA_ARCH_LIST: what torch's extension builder accepts ($out)"
  else
    fail "deep-ep TORCH_CUDA_ARCH_LIST: ${out:-}"; grep -v "^warning:" "$log" | tail -5 || true
  fi
  # One NVSHMEM per process. nixpkgs' torch links cudaPackages.libnvshmem 3.6.5 (stub default,
  # as at 7dec1fd5): DeepEP 1.2.1 is a known-broken pairing with it, so packages.deep-ep builds
  # against `nvshmem` with torch.override { withNvshmem = false; } in its build and Python; a
  # torch without NVSHMEM (older recipe) needs no rebuild; a DeepEP that declares the RC-layout fix
  # follows torch's NVSHMEM; oneNvshmem = "torch" with 1.2.1 is refused naming the rebuild; the
  # `python` dev shell's binding is built against torch's NVSHMEM.
  one_expr="let
      oursWith = torch: import $repo/pkgs { pkgs = import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; inherit torch; }; };
      ours = oursWith { };
      d = ours.packages.deep-ep;
      envTorches = builtins.filter (p: builtins.match \".*torch.*\" p != null) (builtins.filter builtins.isString (builtins.split \" \" d.pythonEnv.paths));
      older = (oursWith { withNvshmem = false; }).packages.deep-ep;
      fixed = d.override { src = d.src; patches = [ $repo/flake.nix ]; knownFixes = [ \"rc-qp-layout-3.5.19\" ]; };
      py = ours.deepepKernelsPythonEnv;
    in [ d.oneNvshmem.use d.oneNvshmem.rebuildTorch d.oneNvshmem.torchNvshmem d.torch.USE_NVSHMEM (envTorches == [ d.torch.outPath ]) d.NVSHMEM_DIR
         older.oneNvshmem.use older.oneNvshmem.rebuildTorch
         fixed.oneNvshmem.use fixed.nvshmem.version fixed.torch.USE_NVSHMEM
         py.oneNvshmem.use py.deepepKernels.nvshmem.version ]"
  want="[\"ours\",true,\"3.6.5-0\",\"0\",true,\"$(nix eval --raw "${stub[@]}" .#packages.x86_64-linux.nvshmem.outPath 2>/dev/null)\",\"ours\",false,\"torch\",\"3.6.5-0\",\"1\",\"torch\",\"3.6.5-0\"]"
  if out=$(nix eval --impure --json --expr "$one_expr" 2>"$log") && [ "$out" = "$want" ]; then
    pass "one NVSHMEM per process: DeepEP 1.2.1 + NVSHMEM 3.4.5 with torch rebuilt without NVSHMEM (torch links 3.6.5); no rebuild for a torch without; a fixed DeepEP and the python shell's binding follow torch's NVSHMEM"
  else
    fail "one NVSHMEM per process: got ${out:-}, want $want"; grep -v "^warning:" "$log" | tail -5 || true
  fi
  # The flake's shells point NVSHMEM_DIR at that one library (our binding prefers $NVSHMEM_DIR/lib).
  if out=$(nix eval --json "${stub[@]}" .#devShells.x86_64-linux --apply 'ds: [ (ds.python.NVSHMEM_DIR == ds.python.deepepKernels.nvshmem.outPath) ds.python.oneNvshmem.use (ds.deep-ep.NVSHMEM_DIR == ds.python.deepepKernels.nvshmem.outPath) ]' 2>"$log") \
    && [ "$out" = '[true,"torch",false]' ]; then
    pass "devShells.python: NVSHMEM_DIR is torch's NVSHMEM, the one its binding was built against; devShells.deep-ep's is DeepEP's own"
  else
    fail "devShells NVSHMEM_DIR: ${out:-}"; grep -v "^warning:" "$log" | tail -5 || true
  fi
  expect_refused 'ps: (ps.deep-ep.override { oneNvshmem = "torch"; }).drvPath' \
    "deep-ep.override { oneNvshmem = \"torch\"; } with torch's NVSHMEM 3.6.5" \
    'oneNvshmem = "torch", but torch links NVSHMEM 3.6.5, a known-broken pairing' 'oneNvshmem = "rebuild-torch"' 'oneNvshmem = "rebuild-torch"'
  # A torch recipe that predates nixpkgs' CUDA 13 support (6b516b42: "Unsupported CUDA version")
  # leaves DeepEP meta.broken with that reason, not an opaque "marked as broken" about torch.
  old_torch_expr="let
      d = (import $repo/pkgs { pkgs = import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; torch = { version = \"2.9.1\"; withNvshmem = false; cudaMajors = [ \"11\" \"12\" ]; narrowedCapabilities = true; }; }; }).packages.deep-ep;
    in [ d.meta.broken (builtins.any (r: builtins.match \".*nixpkgs marks torch 2.9.1 broken here .*Unsupported CUDA version.*\" r != null) (builtins.attrNames d.brokenConditions)) ]"
  if out=$(nix eval --impure --json --expr "$old_torch_expr" 2>"$log") && [ "$out" = '[true,true]' ]; then
    pass "deep-ep with a torch recipe that predates CUDA 13: meta.broken naming torch's \"Unsupported CUDA version\""
  else
    fail "deep-ep with a pre-CUDA-13 torch: ${out:-}"; grep -v "^warning:" "$log" | tail -5 || true
  fi
  # The /proc/self/maps rule itself (checks/nvshmem-maps.py, which the install check of deep-ep
  # and both GPU checks run), on real processes: stand-in torch/extension modules map copies of
  # a shared library named libnvshmem_host.so.3 (the real 3.4.5 wheel's when
  # DEEPEP_NVSHMEM_WHEEL is set, else a copy of the system's libz) from one or two directories.
  if command -v python3 >/dev/null 2>&1; then
    if out=$(bash checks/nvshmem-maps-test.sh 2>"$log"); then
      pass "$out"
    else
      fail "checks/nvshmem-maps.py on fake processes"; printf '%s\n' "${out:-}"; cat "$log"
    fi
  else
    skip "checks/nvshmem-maps.py on fake processes" "no python3"
  fi
  # python3Packages.deepep-kernels from the overlay: our Python package in that Python set, with
  # the overlay's kernels' toolkit, CUDA_HOME and NVSHMEM (the stub's pkgs.cudaPackages is CUDA
  # 12, so a toolkit taken from the scope shows up here).
  pykernels_overlay_expr="let
      flake = builtins.getFlake \"git+file://$repo\";
      prev = import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; };
      final = prev // flake.overlays.default final prev;
      py = (builtins.head final.pythonPackagesExtensions) final.python3Packages { };
      p = py.deepep-kernels; k = final.deepep-kernels;
    in [ (builtins.isString p.drvPath) p.pythonImportsCheck p.cudaPackages.cudaMajorVersion
         (p.env.CUDA_HOME == k.env.CUDA_HOME) (p.nvshmem.outPath == final.nvshmem.outPath) ]"
  if out=$(nix eval --impure --json --expr "$pykernels_overlay_expr" 2>"$log") && [ "$out" = '[true,["deepep_kernels"],"13",true,true]' ]; then
    pass "overlays.default python3Packages.deepep-kernels: $out"
  else
    fail "overlays.default python3Packages.deepep-kernels: ${out:-}"; grep -v "^warning:" "$log" || true
  fi
  # The overlay applied to the stub package set as nixpkgs applies overlays (final = prev //
  # overlay final prev): its names must not depend on `final`, or this recurses forever.
  overlay_expr="let
      flake = builtins.getFlake \"git+file://$repo\";
      prev = import $repo/checks/stub-nixpkgs { system = \"x86_64-linux\"; };
      final = prev // flake.overlays.default final prev;
    in [ final.nvshmem.version final.nvshmem_3_3_9.cudaMajor (builtins.tryEval final.nvshmem_3_3_9_cuda13).success (builtins.isString final.deepep-kernels.drvPath) ]"
  if out=$(nix eval --impure --json --expr "$overlay_expr" 2>"$log") && [ "$out" = '["3.4.5","12",false,true]' ]; then
    pass "overlays.default on a package set: $out"
  else
    fail "overlays.default on a package set: ${out:-}"; grep -v "^warning:" "$log" || true
  fi
  if out=$(nix eval --json "${stub[@]}" .#nixosModules --apply builtins.attrNames 2>"$log") && [ "$out" = '["deepep","default"]' ]; then
    pass "nixosModules: $out"
  else
    fail "nixosModules: ${out:-}"; cat "$log"
  fi

  # The NVSHMEM package's install and fixup shell code on the real wheel (checks/nvshmem-phases.sh).
  if [ -n "${DEEPEP_NVSHMEM_WHEEL:-}" ]; then
    missing_tools=()
    for t in unzip patchelf readelf; do command -v "$t" >/dev/null 2>&1 || missing_tools+=("$t"); done
    if [ ${#missing_tools[@]} -ne 0 ] && [ -n "$(apt_plan)" ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends unzip patchelf binutils >/dev/null 2>&1 || true
    fi
    if out=$(bash checks/nvshmem-phases.sh "$DEEPEP_NVSHMEM_WHEEL" 2>"$log"); then
      pass "$out"
    else
      fail "NVSHMEM package phases on $DEEPEP_NVSHMEM_WHEEL"; cat "$log"
    fi
  else
    skip "NVSHMEM package phases on the real wheel" "set DEEPEP_NVSHMEM_WHEEL=<nvidia_nvshmem_cu13-3.4.5 x86_64 wheel>"
  fi
else
  skip "flake structure" "no checks/stub-nixpkgs"
fi

# ------------------------------------------- 6b. the Rust packages' source set is a workspace
# pkgs/workspace-src.nix lists the files the Rust packages build from; cargo refuses a workspace
# whose member manifests are missing, so copy exactly those paths and ask cargo (offline).
if command -v cargo >/dev/null 2>&1; then
  ws=$(mktemp -d)
  mapfile -t ws_paths < <(grep -oE 'root \+ "/[^"]+"' pkgs/workspace-src.nix | sed -E 's/.*"\/(.*)"/\1/')
  for p in "${ws_paths[@]}"; do mkdir -p "$ws/$(dirname "$p")"; cp -r "$repo/$p" "$ws/$p"; done
  if (cd "$ws" && cargo metadata --offline --locked --format-version 1 >/dev/null 2>"$log"); then
    pass "pkgs/workspace-src.nix (${ws_paths[*]}) is a complete Cargo workspace (cargo metadata --offline)"
  else
    fail "pkgs/workspace-src.nix: cargo refuses the source set (a workspace member missing?)"; grep -v "^warning" "$log" | head -5
  fi
  rm -rf "$ws"
else
  skip "workspace-src.nix" "no cargo"
fi

# ---------------------------------------------------------------- 7. lints
# Exact releases (a new upstream release must not change CI without a commit), built with their
# own Cargo.lock (--locked) into target/tools/cargo-tools, and reused while the version matches.
tools=${DEEPEP_CARGO_TOOLS:-$repo/target/tools/cargo-tools}
export PATH="$tools/bin:$PATH"
for pin in deadnix@1.3.1 nixpkgs-fmt@1.3.0; do
  t=${pin%@*}; v=${pin#*@}
  if [ "$("$tools/bin/$t" --version 2>/dev/null)" != "$t $v" ]; then
    echo "installing $t $v (cargo install --locked --version $v) ..."
    if ! cargo install --quiet --locked --version "$v" "$t" --root "$tools" >"$log" 2>&1; then
      cat "$log"; fail "cargo install --locked --version $v $t"; continue
    fi
  fi
  got=$("$tools/bin/$t" --version 2>/dev/null || true)
  if [ "$got" = "$t $v" ]; then pass "$t $v (pinned)"; else fail "$t: want $v, have '${got:-none}'"; fi
done
existing=()
for f in "${nix_files[@]}"; do [ -e "$f" ] && existing+=("$f"); done
if [ -x "$tools/bin/deadnix" ]; then
  if deadnix --fail "${existing[@]}" >"$log" 2>&1; then pass "deadnix --fail"; else fail "deadnix --fail"; cat "$log"; fi
fi
if [ -x "$tools/bin/nixpkgs-fmt" ]; then
  if nixpkgs-fmt --check "${existing[@]}" >"$log" 2>&1; then pass "nixpkgs-fmt --check"; else
    fail "nixpkgs-fmt --check (run: nixpkgs-fmt <files>)"; cat "$log"
  fi
fi

echo
echo "nix checks: $passed passed, ${#failed[@]} failed"
if [ ${#failed[@]} -ne 0 ]; then
  printf '  failed: %s\n' "${failed[@]}"
  exit 1
fi
