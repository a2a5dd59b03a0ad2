# Two CI checks on the NixOS stand-ins (stand-ins.nix), with no nixpkgs needed:
#   coverage    every option path modules/deepep.nix defines (walked through its mkIf/mkMerge/
#               mkOverride without looking at conditions, so `mkIf false` definitions count) or
#               reads (`config.<path>` in its text) is declared, by the stand-ins or by the
#               module itself; a read of a group of options (e.g. `config.hardware.nvidia` bound
#               to a name) is refused because the paths read through it could not be listed.
#   provenance  every stand-in names the nixpkgs file it mirrors (`mirrors`, a path under
#               nixos/).
#   nix-instantiate --eval --strict --json checks/module/coverage.nix --arg lib 'import ./checks/module/mini-lib.nix'
# Returns { defines; reads; standIns; } (the lists checked) or throws naming every problem.
# `module` and `standIns` can be replaced, to show that the check fails (scripts/nix-checks.sh).
{ lib
, module ? ../../modules/deepep.nix
, standIns ? import ./stand-ins.nix { }
}:
let
  inherit (builtins) attrNames concatLists concatStringsSep filter foldl' genList head isAttrs isString length match readFile split;
  concatMap = f: l: concatLists (map f l);
  unique = foldl' (acc: x: if builtins.elem x acc then acc else acc ++ [ x ]) [ ];
  show = concatStringsSep ".";

  # ---------------------------------------------------------------- provenance
  unsourced = filter (i: match "nixos/.+[.]nix" ((builtins.elemAt standIns i).mirrors or "") == null)
    (genList (i: i) (length standIns));

  # ---------------------------------------------------------------- declarations
  isOption = v: isAttrs v && (v._type or "") == "option";
  declared = (lib.evalModules {
    modules = map (s: s.module) standIns ++ [ module ];
    specialArgs.pkgs = { };
  }).options;

  # The option a path lies in: the longest declared prefix that is an option, or null.
  optionOf = path:
    let
      go = decl: rest: done:
        if isOption decl then done
        else if rest == [ ] || !(isAttrs decl) || !(decl ? ${head rest}) then null
        else go decl.${head rest} (builtins.tail rest) (done ++ [ (head rest) ]);
    in
    go declared path [ ];

  # ---------------------------------------------------------------- definitions
  # The module's `config`, called with arguments nothing is read from (the walk looks only at
  # attribute names and property wrappers).
  moduleValue = import module {
    config = throw "coverage.nix: the walk must not read config";
    options = throw "coverage.nix: the walk must not read options";
    inherit lib;
    pkgs = throw "coverage.nix: the walk must not read pkgs";
  };
  # mkIf / mkMerge / mkOverride opened without evaluating a condition.
  open = v:
    let t = if isAttrs v then v._type or "" else "";
    in
    if t == "merge" then concatMap open v.contents
    else if t == "if" || t == "override" then open v.content
    else [ v ];
  isGroup = v: isAttrs v && !(v ? _type) && (v.type or null) != "derivation";
  # A value that can only be computed from config (the module's own text, say) is a leaf.
  try = f: default: let r = builtins.tryEval f; in if r.success then r.value else default;
  definedPaths = path: v:
    if optionOf path != null then [ path ]
    else
      concatMap (x: if try (isGroup x) false then concatMap (n: definedPaths (path ++ [ n ]) x.${n}) (attrNames x) else [ path ])
        (try (open v) [ null ]);
  defines = unique (definedPaths [ ] (moduleValue.config or { }));
  undeclaredDefines = filter (p: optionOf p == null) defines;

  # ---------------------------------------------------------------- reads
  text = readFile module;
  reads = unique (map (m: head m)
    (filter (x: !(isString x)) (split "config[.]([A-Za-z_][A-Za-z0-9_-]*([.][A-Za-z_][A-Za-z0-9_-]*)*)" text)));
  readPath = r: filter isString (split "[.]" r);
  # `config.services.deepep` (the module's own options, bound to `cfg`) is the one group read allowed.
  badReads = filter (r: r != "services.deepep" && optionOf (readPath r) == null) reads;

  problems =
    map (i: "stand-in #${toString i} of checks/module/stand-ins.nix names no nixpkgs file (mirrors = \"nixos/...nix\")") unsourced
    ++ map (p: "modules/deepep.nix defines ${show p}, which no stand-in declares (is it a real NixOS option? declare it in checks/module/stand-ins.nix with the nixpkgs file it mirrors)") undeclaredDefines
    ++ map (r: "modules/deepep.nix reads config.${r}, which is no declared option (a group of options bound to a name hides the paths read through it: write them out; a real NixOS option missing from checks/module/stand-ins.nix: declare it there)") badReads;
in
if problems != [ ] then throw ("option coverage / provenance:\n  " + concatStringsSep "\n  " problems)
else {
  defines = map show defines;
  inherit reads;
  standIns = map (s: s.mirrors) standIns;
}
