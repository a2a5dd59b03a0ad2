# A small stand-in for nixpkgs' module system (lib.evalModules, mkOption, mkIf, mkMerge,
# mkOverride, the option types the module and the NixOS stand-ins use) plus the few list/string
# functions they call. It exists because CI has no nixpkgs (scripts/nix-checks.sh, step 5):
# with it, the services.deepep cases run on every CI run; with NIXPKGS_LIB set, the same cases
# also run through nixpkgs' real lib (checks/module/lib-eval.nix takes either).
#
# Semantics follow nixpkgs' lib/modules.nix and lib/types.nix for what is implemented:
#   - defining an undeclared option is an error, also under `mkIf false` (the definition is
#     pushed down to the option path before any condition is looked at);
#   - mkIf / mkMerge / mkOverride (mkDefault 1000, mkForce 50, option default 1500) are
#     discharged per option; only the definitions of the highest priority are merged;
#   - every definition is checked against the option type ("is not of type");
#   - bool/str/int/enum/strMatching merge only equal values, lines join with "\n", listOf
#     concatenates (elements may be mkIf), attrsOf merges per name and drops names whose
#     definitions are all `mkIf false`, nullOr refuses null next to non-null, package/raw take
#     one definition, submodules are evaluated as nested modules;
#   - readOnly options refuse a second definition; `apply` is applied.
# Not implemented (not used by the module or the stand-ins): mkBefore/mkAfter ordering,
# freeformType, _module.args, option merging across several declarations, mkRenamedOptionModule.
let
  stub = import ../stub-nixpkgs/lib.nix;
  inherit (builtins)
    all
    any
    attrNames
    concatLists
    concatStringsSep
    elem
    filter
    foldl'
    head
    isAttrs
    isBool
    isFunction
    isInt
    isList
    isPath
    isString
    length
    listToAttrs
    mapAttrs
    match
    toJSON
    ;

  concatMap = f: l: concatLists (map f l);
  unique = foldl' (acc: x: if elem x acc then acc else acc ++ [ x ]) [ ];
  showOption = loc: concatStringsSep "." loc;
  typeOf = v: v._type or "";
  showDefs = defs: concatStringsSep "" (map (d: "\n- In `${d.file}': ${toJSON (if isAttrs d.value || isList d.value || isFunction d.value then "<${builtins.typeOf d.value}>" else d.value)}") defs);

  # ------------------------------------------------------------------ properties
  mkIf = condition: content: { _type = "if"; inherit condition content; };
  mkMerge = contents: { _type = "merge"; inherit contents; };
  mkOverride = priority: content: { _type = "override"; inherit priority content; };

  # mkMerge and mkIf removed (conditions evaluated here, as in lib.modules.dischargeProperties).
  discharge = v:
    if typeOf v == "merge" then concatMap discharge v.contents
    else if typeOf v == "if" then
      (if isBool v.condition then (if v.condition then discharge v.content else [ ])
      else throw "mkIf called with a non-Boolean condition")
    else [ v ];

  # mkMerge / mkIf / mkOverride on an attribute set moved onto each attribute
  # (lib.modules.pushDownProperties); the conditions are not looked at.
  pushDown = v:
    if typeOf v == "merge" then concatMap pushDown v.contents
    else if typeOf v == "if" then map (mapAttrs (_: x: mkIf v.condition x)) (pushDown v.content)
    else if typeOf v == "override" then map (mapAttrs (_: x: mkOverride v.priority x)) (pushDown v.content)
    else [ v ];

  # ------------------------------------------------------------------ merging
  mergeDefinitions = loc: type: defs:
    let
      d1 = concatMap (d: map (v: { inherit (d) file; value = v; }) (discharge d.value)) defs;
      prio = d: if typeOf d.value == "override" then d.value.priority else 100;
      best = foldl' (a: d: if prio d < a then prio d else a) 10000 d1;
      strip = v: if typeOf v == "override" then strip v.content else v;
      d2 = concatMap (d: map (v: { inherit (d) file; value = v; }) (discharge (strip d.value))) (filter (d: prio d == best) d1);
      bad = filter (d: !(type.check d.value)) d2;
    in
    {
      isDefined = d2 != [ ];
      mergedValue =
        if bad != [ ] then
          throw "A definition for option `${showOption loc}' is not of type `${type.description}'. Definition values:${showDefs bad}"
        else type.merge loc d2;
    };

  mergeEqualOption = loc: defs:
    let v = (head defs).value;
    in
    if all (d: d.value == v) defs then v
    else throw "The option `${showOption loc}' has conflicting definition values:${showDefs defs}";

  mergeOneOption = loc: defs:
    if length defs == 1 then (head defs).value
    else throw "The option `${showOption loc}' is defined multiple times while it's expected to be unique.${showDefs defs}";

  mergeDefaultOption = loc: defs:
    let vs = map (d: d.value) defs;
    in
    if length vs == 1 then head vs
    else if all isList vs then concatLists vs
    else if all isAttrs vs then foldl' (a: b: a // b) { } vs
    else if all isBool vs then any (x: x) vs
    else if all isString vs then concatStringsSep "" vs
    else mergeEqualOption loc defs;

  # ------------------------------------------------------------------ types
  mkType = { name, description ? name, check ? (_: true), merge ? mergeDefaultOption, getSubOptions ? null }:
    { _type = "option-type"; inherit name description check merge getSubOptions; };

  isDerivation = v: isAttrs v && (v.type or null) == "derivation";

  types = rec {
    unspecified = mkType { name = "unspecified"; };
    raw = mkType { name = "raw"; merge = mergeOneOption; };
    bool = mkType { name = "bool"; description = "boolean"; check = isBool; merge = mergeEqualOption; };
    int = mkType { name = "int"; description = "signed integer"; check = isInt; merge = mergeEqualOption; };
    ints = {
      positive = mkType { name = "positiveInt"; description = "positive integer, meaning >0"; check = x: isInt x && x > 0; merge = mergeEqualOption; };
      unsigned = mkType { name = "unsignedInt"; description = "unsigned integer, meaning >=0"; check = x: isInt x && x >= 0; merge = mergeEqualOption; };
      between = lo: hi: mkType { name = "intBetween"; description = "integer between ${toString lo} and ${toString hi} (both inclusive)"; check = x: isInt x && x >= lo && x <= hi; merge = mergeEqualOption; };
    };
    str = mkType { name = "str"; description = "string"; check = isString; merge = mergeEqualOption; };
    lines = mkType { name = "lines"; description = "strings concatenated with \"\\n\""; check = isString; merge = _: defs: concatStringsSep "\n" (map (d: d.value) defs); };
    strMatching = re: mkType { name = "strMatching ${toJSON re}"; description = "string matching the pattern ${re}"; check = x: isString x && match re x != null; merge = mergeEqualOption; };
    path = mkType { name = "path"; check = x: isPath x || (isString x && builtins.substring 0 1 x == "/") || isDerivation x; merge = mergeEqualOption; };
    package = mkType { name = "package"; check = x: isDerivation x || isPath x || isString x; merge = mergeOneOption; };
    enum = values: mkType { name = "enum"; description = "one of ${concatStringsSep ", " (map toJSON values)}"; check = x: elem x values; merge = mergeEqualOption; };
    nullOr = t: mkType {
      name = "nullOr";
      description = "null or ${t.description}";
      check = x: x == null || t.check x;
      merge = loc: defs:
        if all (d: d.value == null) defs then null
        else if any (d: d.value == null) defs then throw "The option `${showOption loc}' is defined both null and not null, in${showDefs defs}"
        else t.merge loc defs;
    };
    oneOf = ts: mkType {
      name = "oneOf";
      description = concatStringsSep " or " (map (t: t.description) ts);
      check = x: any (t: t.check x) ts;
      merge = loc: defs:
        let fits = filter (t: all (d: t.check d.value) defs) ts;
        in if fits != [ ] then (head fits).merge loc defs else mergeOneOption loc defs;
    };
    listOf = t: mkType {
      name = "listOf";
      description = "list of ${t.description}";
      check = isList;
      merge = loc: defs: concatMap
        (d: concatMap
          (x: let r = mergeDefinitions (loc ++ [ "*" ]) t [{ inherit (d) file; value = x; }]; in if r.isDefined then [ r.mergedValue ] else [ ])
          d.value)
        defs;
    };
    attrsOf = t: mkType {
      name = "attrsOf";
      description = "attribute set of ${t.description}";
      check = isAttrs;
      merge = loc: defs:
        let
          names = unique (concatMap (d: attrNames d.value) defs);
          perName = n: mergeDefinitions (loc ++ [ n ]) t
            (concatMap (d: if d.value ? ${n} then [{ inherit (d) file; value = d.value.${n}; }] else [ ]) defs);
          results = map (n: { name = n; r = perName n; }) names;
        in
        listToAttrs (map (x: { inherit (x) name; value = x.r.mergedValue; }) (filter (x: x.r.isDefined) results));
    };
    # `module` declares the submodule's options ({ options = ...; }), as in nixpkgs.
    submodule = module: mkType {
      name = "submodule";
      check = x: isAttrs x || isFunction x;
      merge = _: defs: (evalModules { modules = [ module ] ++ map (d: d.value) defs; }).config;
    };
  };

  mkOption = attrs: attrs // { _type = "option"; type = attrs.type or types.unspecified; };
  isOption = v: isAttrs v && typeOf v == "option";

  # ------------------------------------------------------------------ evaluation
  # evalModules { modules; specialArgs ? { } } -> { config; options; }
  # `options` is the merged declaration tree (mkOption values at the leaves).
  evalModules = { modules, specialArgs ? { } }:
    let
      args = { inherit lib config options; } // specialArgs;

      # [ { file; options; config; } ] for the modules and everything they import.
      collect = file: m:
        let
          v = if isPath m || isString m then import m else m;
          f = if isPath m || isString m then toString m else file;
          r = if isFunction v then v args else v;
          explicit = r ? options || r ? config;
          self = {
            file = r._file or f;
            options = r.options or { };
            config = if explicit then r.config or { } else removeAttrs r [ "imports" "_file" "key" ];
          };
        in
        [ self ] ++ concatMap (collect f) (r.imports or [ ]);

      collected = concatMap (collect "<unknown-file>") modules;

      # Declarations merged into one tree; a path declared twice is an error.
      mergeDecls = loc: trees:
        let
          names = unique (concatMap attrNames trees);
          at = n: filter (t: t ? ${n}) trees;
        in
        listToAttrs (map
          (n:
            let here = map (t: t.${n}) (at n);
            in {
              name = n;
              value =
                if any isOption here then
                  (if length here == 1 then head here else throw "The option `${showOption (loc ++ [ n ])}' is declared more than once (this stand-in module system cannot merge declarations).")
                else mergeDecls (loc ++ [ n ]) here;
            })
          names);

      options = mergeDecls [ ] (map (m: m.options) collected);

      evalOption = loc: opt: defs:
        let
          withDefault = defs ++ (if opt ? default then [{ file = "<default>"; value = mkOverride 1500 opt.default; }] else [ ]);
          merged = mergeDefinitions loc opt.type withDefault;
          value =
            if merged.isDefined then merged.mergedValue
            else throw "The option `${showOption loc}' was accessed but has no value defined. Try setting the option.";
        in
        if (opt.readOnly or false) && length defs > 1 then
          throw "The option `${showOption loc}' is read-only, but it's set multiple times.${showDefs defs}"
        else if opt ? apply then opt.apply value else value;

      evalLevel = loc: decl: defs:
        let
          pushed = concatMap (d: map (v: { inherit (d) file; value = v; }) (pushDown d.value)) defs;
          notSets = filter (d: !(isAttrs d.value)) pushed;
          undeclared = concatMap (d: map (n: { inherit n; inherit (d) file; }) (filter (n: !(decl ? ${n})) (attrNames d.value))) pushed;
        in
        if notSets != [ ] then
          throw "The option `${showOption loc}' does not exist (a value is defined for it, but it is a group of options).${showDefs notSets}"
        else if undeclared != [ ] then
          throw "The option `${showOption (loc ++ [ (head undeclared).n ])}' does not exist. Definition values:\n- In `${(head undeclared).file}'"
        else
          mapAttrs
            (n: sub:
              let subDefs = concatMap (d: if d.value ? ${n} then [{ inherit (d) file; value = d.value.${n}; }] else [ ]) pushed;
              in if isOption sub then evalOption (loc ++ [ n ]) sub subDefs else evalLevel (loc ++ [ n ]) sub subDefs)
            decl;

      rootDefs = map (m: { inherit (m) file; value = m.config; }) collected;

      # Every definition's path, checked against the declarations before any value is used
      # (as nixpkgs' evalModules does through `unmatchedDefns`): a definition of an undeclared
      # option fails the evaluation even under `mkIf false`.
      undeclared = loc: decl: defs:
        let
          pushed = concatMap (d: map (v: { inherit (d) file; value = v; }) (pushDown d.value)) defs;
          sets = filter (d: isAttrs d.value) pushed;
          names = unique (concatMap (d: attrNames d.value) sets);
        in
        concatMap
          (n:
            let subDefs = concatMap (d: if d.value ? ${n} then [{ inherit (d) file; value = d.value.${n}; }] else [ ]) sets;
            in
            if !(decl ? ${n}) then [{ loc = loc ++ [ n ]; inherit (head subDefs) file; }]
            else if isOption decl.${n} then [ ]
            else undeclared (loc ++ [ n ]) decl.${n} subDefs)
          names;
      unmatched = undeclared [ ] options rootDefs;

      config =
        if unmatched != [ ] then
          throw "The option `${showOption (head unmatched).loc}' does not exist. Definition values:\n- In `${(head unmatched).file}'"
        else evalLevel [ ] options rootDefs;
    in
    { inherit config options; };

  lib = stub // {
    inherit mkIf mkMerge mkOverride mkOption types evalModules unique showOption concatMap isOption;
    mkDefault = mkOverride 1000;
    mkForce = mkOverride 50;
    mkOptionDefault = mkOverride 1500;
    mkEnableOption = name: mkOption { type = types.bool; default = false; example = true; description = "Whether to enable ${name}."; };
    literalExpression = text: { _type = "literalExpression"; inherit text; };
    literalMD = text: { _type = "literalMD"; inherit text; };
    inherit (builtins) length head elemAt mapAttrs concatLists isAttrs isList isString isBool;
    hasInfix = infix: s: length (builtins.split (escapeRegex infix) s) > 1;
    versionOlder = a: b: builtins.compareVersions a b < 0;
    id = x: x;
  };

  # Regex-quotes every character that is special in POSIX extended regular expressions.
  escapeRegex = builtins.replaceStrings
    [ "\\" "." "[" "]" "(" ")" "{" "}" "*" "+" "?" "^" "$" "|" ]
    [ "\\\\" "\\." "\\[" "\\]" "\\(" "\\)" "\\{" "\\}" "\\*" "\\+" "\\?" "\\^" "\\$" "\\|" ];
in
lib
