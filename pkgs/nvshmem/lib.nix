# Pure helpers over the generated NVSHMEM release data (releases.nix): which artifact an
# attribute means, which attributes exist, and the evaluation errors for combinations that do
# not exist. Builtins only (no nixpkgs), so checks/pure.nix runs them with Debian's Nix 2.8.
#
# Release data shape (rendered by `deepep-nix render`):
#   { "<version>" = { releaseDate = "YYYY-MM-DD" | null;
#                     <system> = { "<cudaMajor>" = { nvidia = { url; hash; size; };
#                                                      pypi = { url; hash; size; filename; }; }; }; }; }
# Keys are absent where no artifact exists.
let
  inherit (builtins)
    attrNames
    compareVersions
    concatStringsSep
    elem
    filter
    head
    replaceStrings
    sort
    ;

  quoteAll = xs: concatStringsSep ", " (map (x: "\"${x}\"") xs);
in
rec {
  cudaMajors = [ "12" "13" ];
  sources = [ "nvidia" "pypi" ];
  systems = [ "x86_64-linux" "aarch64-linux" ];

  # The version the plain `nvshmem` attribute builds: the last line DeepEP v1.2.1's IBGDA code
  # supports (3.5.19 changed the IBGDA RC QP layout), for CUDA 13.
  defaultVersion = "3.4.5";
  defaultCudaMajor = "13";

  # "3.3.20" -> "3_3_20" (attribute-name form).
  attrVersion = replaceStrings [ "." ] [ "_" ];

  # Versions of the data, oldest first (numeric order: 3.3.9 < 3.3.20).
  versions = releases: sort (a: b: compareVersions a b < 0) (attrNames releases);

  # CUDA majors with at least one artifact for `version` on `system`, ascending.
  cudaMajorsFor = releases: version: system:
    filter (m: (releases.${version}.${system} or { }) ? ${m}) cudaMajors;

  # Sources with an artifact for (version, system, cudaMajor), in preference order.
  sourcesFor = releases: version: system: cudaMajor:
    filter (s: ((releases.${version}.${system} or { }).${cudaMajor} or { }) ? ${s}) sources;

  # The first version (oldest) that has a build for `cudaMajor` on `system`, or null.
  firstVersionWith = releases: system: cudaMajor:
    let vs = filter (v: elem cudaMajor (cudaMajorsFor releases v system)) (versions releases);
    in if vs == [ ] then null else head vs;

  # The CUDA major a version-only attribute (nvshmem_3_4_5) uses: 13 where it exists, else 12.
  preferredCudaMajor = releases: version: system:
    let ms = cudaMajorsFor releases version system;
    in if elem "13" ms then "13" else if elem "12" ms then "12" else null;

  # Resolve a request to one artifact or fail with an error that names what exists.
  #   cudaMajor = null  -> preferredCudaMajor
  #   source    = null  -> the NVIDIA tarball where one exists, else the PyPI wheel
  # Returns { version; cudaMajor; source; releaseDate; artifact = { url; hash; size; filename? }; }.
  select = { releases, version, system, cudaMajor ? null, source ? null }:
    let
      known = versions releases;
      rel = releases.${version};
      availableSystems = filter (s: rel ? ${s}) systems;
      major = if cudaMajor == null then preferredCudaMajor releases version system else cudaMajor;
      majorsHere = cudaMajorsFor releases version system;
      firstWithMajor = firstVersionWith releases system major;
      majorHint =
        if firstWithMajor == null then "no release in the data has a CUDA ${major} build for ${system}"
        else if compareVersions firstWithMajor version > 0 then "the first is ${firstWithMajor}"
        else "other versions have one";
      attrsForMajors = concatStringsSep " or " (map (m: "nvshmem_${attrVersion version}_cuda${m}") majorsHere);
      srcs = sourcesFor releases version system major;
      chosenSource = if source == null then head srcs else source;
      srcAttr = { nvidia = "NVIDIA tarball"; pypi = "PyPI wheel"; };
    in
    if !(releases ? ${version}) then
      throw ''
        NVSHMEM ${version} is not in the release data (pkgs/nvshmem/releases.nix); known versions: ${concatStringsSep ", " known}.
        A newer release needs `deepep-nix lock` and `deepep-nix render` first.''
    else if !(elem system systems) then
      throw "NVSHMEM packages exist for ${concatStringsSep " and " systems} only, not ${system}."
    else if !(rel ? ${system}) then
      throw "NVSHMEM ${version} has no ${system} build in the release data; it exists for: ${concatStringsSep ", " availableSystems}."
    else if cudaMajor != null && !(elem cudaMajor cudaMajors) then
      throw "cudaMajor = \"${cudaMajor}\" is not supported; use one of ${quoteAll cudaMajors}."
    else if !(elem major majorsHere) then
      throw ''
        NVSHMEM ${version} has no CUDA ${major} build for ${system}; ${majorHint}; use ${attrsForMajors}${
          if firstWithMajor == null then "" else " or a newer version's cuda${major} attribute (e.g. nvshmem_${attrVersion firstWithMajor}_cuda${major})"
        }.''
    else if source != null && !(elem source sources) then
      throw "source = \"${source}\" is not supported; use one of ${quoteAll sources}."
    else if !(elem chosenSource srcs) then
      throw ''
        NVSHMEM ${version} (${system}, CUDA ${major}) has no ${srcAttr.${chosenSource}} in the release data; available: ${quoteAll srcs}; use .override { source = "${head srcs}"; }.''
    else {
      inherit version;
      cudaMajor = major;
      source = chosenSource;
      releaseDate = rel.releaseDate or null;
      artifact = rel.${system}.${major}.${chosenSource};
    };

  # Attributes to expose for `system`: for every version with a build there,
  #   nvshmem_<v>            (preferred CUDA major)
  #   nvshmem_<v>_cuda<M>    (every major that exists)
  # plus `nvshmem` itself (defaultVersion / defaultCudaMajor) when it exists.
  # Each entry: { name; version; cudaMajor (null = preferred); }.
  attrPlan = releases: system:
    let
      vs = filter (v: cudaMajorsFor releases v system != [ ]) (versions releases);
      perVersion = v:
        [{ name = "nvshmem_${attrVersion v}"; version = v; cudaMajor = null; }]
        ++ map (m: { name = "nvshmem_${attrVersion v}_cuda${m}"; version = v; cudaMajor = m; }) (cudaMajorsFor releases v system);
      hasDefault = elem defaultCudaMajor (cudaMajorsFor releases defaultVersion system);
    in
    (if hasDefault then [{ name = "nvshmem"; version = defaultVersion; cudaMajor = defaultCudaMajor; }] else [ ])
    ++ builtins.concatMap perVersion vs;

  # Attributes that name a combination that does not exist (nvshmem_3_3_9_cuda13): for every
  # version present on `system`, each CUDA major it lacks. The package set binds them to the
  # evaluation error of `select`, so asking for one says what exists instead of falling back.
  missingAttrPlan = releases: system:
    let vs = filter (v: cudaMajorsFor releases v system != [ ]) (versions releases);
    in builtins.concatMap
      (v: map (m: { name = "nvshmem_${attrVersion v}_cuda${m}"; version = v; cudaMajor = m; })
        (filter (m: !(elem m (cudaMajorsFor releases v system))) cudaMajors))
      vs;
}
