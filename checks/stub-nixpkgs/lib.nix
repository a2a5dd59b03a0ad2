# The subset of nixpkgs' lib that flake.nix and pkgs/ use, reimplemented for the stub. Semantics
# follow nixpkgs' lib for the cases used here; anything else is missing on purpose (an
# evaluation error then names the function to add).
let
  inherit (builtins)
    compareVersions
    isList
    isString
    parseDrvName
    split
    stringLength
    substring
    ;
in
rec {
  inherit (builtins) all any elem attrNames concatStringsSep filter listToAttrs;

  genAttrs = names: f: listToAttrs (map (n: nameValuePair n (f n)) names);
  nameValuePair = name: value: { inherit name value; };
  filterAttrs = pred: set: listToAttrs (map (n: nameValuePair n set.${n}) (filter (n: pred n set.${n}) (attrNames set)));
  toList = x: if isList x then x else [ x ];
  optional = cond: x: if cond then [ x ] else [ ];
  optionals = cond: xs: if cond then xs else [ ];
  optionalString = cond: s: if cond then s else "";
  optionalAttrs = cond: set: if cond then set else { };
  concatMapStringsSep = sep: f: xs: concatStringsSep sep (map f xs);
  hasPrefix = pre: s: substring 0 (stringLength pre) s == pre;
  splitString = sep: s: filter isString (split sep s);
  versionAtLeast = a: b: compareVersions a b >= 0;
  importTOML = path: builtins.fromTOML (builtins.readFile path);

  getName = x: x.pname or (parseDrvName x.name).name;
  getOutput = output: pkg: pkg.${output} or pkg.out or pkg;
  getLib = getOutput "lib";
  getBin = getOutput "bin";
  getDev = getOutput "dev";
  getInclude = pkg: pkg.include or pkg.dev or pkg.out or pkg;
  makeSearchPath = sub: paths: concatStringsSep ":" (map (p: "${p}/${sub}") paths);
  makeLibraryPath = pkgs: makeSearchPath "lib" (map getLib pkgs);
  makeBinPath = pkgs: makeSearchPath "bin" (map getBin pkgs);

  licenses = {
    mit = { shortName = "MIT"; free = true; };
    asl20 = { shortName = "Apache-2.0"; free = true; };
    gpl2Only = { shortName = "GPL-2.0-only"; free = true; };
    nvidiaCuda = { shortName = "CUDA EULA"; free = false; };
    nvidiaCudaRedist = { shortName = "CUDA EULA"; free = false; redistributable = true; };
  };
  sourceTypes.binaryNativeCode = { shortName = "binaryNativeCode"; isSource = false; };
  platforms.linux = [ "x86_64-linux" "aarch64-linux" ];

  # Files under `root` that are, contain, or lie below one of the listed paths.
  fileset = {
    unions = paths: paths;
    toSource = { root, fileset }:
      builtins.path {
        path = root;
        name = "source";
        filter = p: _: any
          (f: let fs = toString f; in p == fs || hasPrefix (fs + "/") p || hasPrefix (p + "/") fs)
          fileset;
      };
  };
}
