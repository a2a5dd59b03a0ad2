# The minimum Nix feature set, as nixpkgs' lib/minfeatures.nix states it (read at NixOS/nixpkgs
# 18d54ee87a5f1865f1c9976fa15e6439c82cb205; introduced by nixpkgs PR #433057, 2025-08): the
# `nixVersion` builtin must exist and report at least 2.18 (Lix always reports "2.18.3-lix",
# so 2.18 is where nixpkgs leaves the version and adds feature checks instead). Written here
# from that file's logic; ./default.nix refuses to evaluate when anything is missing, as
# nixpkgs' default.nix does. `builtins` is whatever the importing scope calls builtins, so a test
# can stand in another Nix version with scopedImport (scripts/nix-checks.sh).
let
  features = [
    { description = "the `nixVersion` builtin"; ok = builtins ? nixVersion; }
    {
      description = "`builtins.nixVersion` reports at least 2.18";
      ok = builtins ? nixVersion && builtins.compareVersions builtins.nixVersion "2.18" >= 0;
    }
  ];
in
{
  all = features;
  missing = builtins.filter (f: !f.ok) features;
}
